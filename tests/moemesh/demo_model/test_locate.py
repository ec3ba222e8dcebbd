from __future__ import annotations

from pathlib import Path

import pytest

from moemesh.demo_model import default_demo_dir, ensure_demo_model, find_demo_gguf


def test_default_demo_dir_honours_moemesh_home(monkeypatch, tmp_path):
    monkeypatch.setenv("MOEMESH_HOME", str(tmp_path))
    assert default_demo_dir() == tmp_path / "demo-smollm2-moe"
    monkeypatch.delenv("MOEMESH_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert default_demo_dir() == Path(tmp_path / "home" / ".cache" / "moemesh" / "demo-smollm2-moe")


def test_find_demo_gguf():
    path = find_demo_gguf()
    assert path.suffix == ".gguf" and path.is_file()
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"


@pytest.mark.slow  # builds the real demo model
def test_ensure_demo_model_reuses_a_built_model(demo_dir, monkeypatch):
    monkeypatch.setenv("MOEMESH_HOME", str(demo_dir.parent))
    messages: list[str] = []
    assert ensure_demo_model(progress=messages.append) == demo_dir
    assert any("skipping" in m for m in messages)
