"""`Mesh.supervise`: a child that exits is started again (same command line) after a growing backoff;
past the policy's limit it is reported failed and left alone while the others run on."""
from __future__ import annotations

import sys
import threading

import pytest

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.mesh import Mesh, MeshSpec, RestartPolicy


@pytest.mark.slow  # children restarted with backoff: > 2 s
def test_restarts_with_backoff_then_gives_up(tmp_path):
    mesh = Mesh(MeshSpec(model_dir="/m"), tmp_path)
    flaky = [sys.executable, "-c", "import sys; print('flaky run', flush=True); sys.exit(3)"]
    steady = [sys.executable, "-c", "import time; time.sleep(60)"]
    for name, argv in (("flaky", flaky), ("steady", steady)):
        mesh.children.append(Child(name, argv, tmp_path / f"{name}.log"))
        mesh._argv[name] = argv
    lines: list[str] = []
    stop = threading.Event()
    policy = RestartPolicy(max_restarts=3, window_s=60, backoff_initial_s=0.05, backoff_max_s=0.2)
    timer = threading.Timer(3.0, stop.set)
    timer.start()
    try:
        failed = mesh.supervise(stop, policy, poll_s=0.02, report=lines.append)
    finally:
        timer.cancel()
        stop_all(mesh.children, 5)
    assert failed == ["flaky"]
    restarts = [l for l in lines if l.startswith("moemesh up: restarted flaky")]
    assert len(restarts) == 3
    assert any("flaky exited with 3 4 times" in l and "not restarting it" in l for l in lines)
    assert not any("steady" in l for l in lines)
    assert (tmp_path / "flaky.log").read_text().count("flaky run") == 4  # the log is appended to
    assert [policy.delay(n) for n in (1, 2, 3, 4)] == [0.05, 0.1, 0.2, 0.2]
