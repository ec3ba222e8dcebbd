"""The container images: built from pyproject.toml, stubs generated at build time, non-root, one entry point."""
import json
import re
from pathlib import Path

import pytest

from deploy.manifest import pod_specs
from tests.deploy.manifests import OVERLAYS, rendered

DOCKER = Path(__file__).resolve().parents[2] / "deploy" / "docker"
ROOT = DOCKER.parents[1]


def final_stage(text: str) -> str:
    return text[text.rindex("\nFROM ") :]


@pytest.mark.parametrize("name", ["cpu.Dockerfile", "cuda.Dockerfile"])
def test_dockerfile(name):
    text = (DOCKER / name).read_text()
    assert "COPY pyproject.toml" in text and re.search(r'pip install "?\.\[', text), "installs the project from pyproject.toml"
    assert "ensure_generated()" in text, "generates the gRPC stubs during the build"
    for pkg in ("moemesh", "kernels", "router_svc", "attention_svc", "expert_svc", "control_svc", "gateway_svc", "protos"):
        assert f"COPY {pkg} " in text
        assert (ROOT / pkg).is_dir()
    last = final_stage(text)
    user = re.search(r"^USER (\d+):(\d+)$", last, re.MULTILINE)
    assert user and user.group(1) != "0"
    entry = re.search(r"^ENTRYPOINT (.+)$", last, re.MULTILINE)
    assert json.loads(entry.group(1)) == ["moemesh"]
    assert (DOCKER / f"{name}.dockerignore").is_file()


def test_cuda_image_uses_a_cuda_torch():
    text = (DOCKER / "cuda.Dockerfile").read_text()
    assert "nvidia/cuda:" in text and "whl/cu1" in text
    assert "whl/cpu" in (DOCKER / "cpu.Dockerfile").read_text()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_manifests_run_the_image_user_and_entry_point(overlay):
    uid = int(re.search(r"^USER (\d+):", final_stage((DOCKER / "cpu.Dockerfile").read_text()), re.MULTILINE).group(1))
    for o in rendered(overlay):
        for spec in pod_specs(o):
            assert spec["securityContext"]["runAsUser"] == uid
            for c in spec.get("containers", []) + spec.get("initContainers", []):
                assert c["image"].split("/")[-1].startswith("moemesh:")
                assert "command" not in c or c["command"][0] in ("moemesh", "sh")


def _snapshot(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime for p in root.rglob("*")}


def test_build_time_stubs_serve_a_read_only_install(tmp_path):
    """The images' recipe: stubs generated into the installed package at build time (sources from
    MOEMESH_PROTO_DIR); at run time, with no proto sources beside the package, every service's stubs
    load and nothing under the package is written (its root filesystem is read-only)."""
    import os
    import shutil
    import subprocess
    import sys

    site = tmp_path / "site-packages"
    shutil.copytree(ROOT / "moemesh", site / "moemesh", ignore=shutil.ignore_patterns("_proto", "__pycache__"))
    env = {k: v for k, v in os.environ.items() if k != "MOEMESH_PROTO_DIR"}
    env.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    build = "from moemesh.rpc.protos import ensure_generated; ensure_generated()"
    subprocess.run([sys.executable, "-c", build], env={**env, "MOEMESH_PROTO_DIR": str(ROOT / "protos")},
                   cwd=tmp_path, check=True, timeout=120)
    assert (site / "moemesh" / "_proto" / "STAMP").is_file() and not (site / "protos").exists()
    before = _snapshot(site)
    run = "from moemesh.rpc.protos import load\nfor n in ('control', 'expert', 'tensor'):\n    load(n)\nprint('ok')"
    out = subprocess.run([sys.executable, "-c", run], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
    assert _snapshot(site) == before
