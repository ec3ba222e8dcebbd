from __future__ import annotations

import pytest

from moemesh.cli.main import build_parser, main


def test_demo_model_builds_then_skips(tiny_gguf, tmp_path, capsys):
    path, _, _ = tiny_gguf
    out = tmp_path / "m"
    assert main(["demo-model", str(out), "--gguf", str(path), "--dtype", "bfloat16"]) == 0
    captured = capsys.readouterr()
    assert captured.out.strip() == str(out)
    assert "converting layer 2/2" in captured.err
    assert (out / "model.safetensors").is_file()
    assert main(["demo-model", str(out), "--gguf", str(path), "--dtype", "bfloat16"]) == 0
    assert "skipping" in capsys.readouterr().err


def test_demo_model_error_exit(tmp_path, capsys):
    (tmp_path / "keep.txt").write_text("x")
    assert main(["demo-model", str(tmp_path), "--gguf", str(tmp_path / "keep.txt")]) == 2
    assert "error" in capsys.readouterr().err


def test_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["demo-model", "--help"])
    out = capsys.readouterr().out
    assert "--dtype" in out and "--force" in out and "OUT_DIR" in out
