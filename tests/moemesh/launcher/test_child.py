import os
import subprocess
import sys
import time

import psutil
import pytest

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.health import ChildExited, wait_serving
from moemesh.launcher.mesh import MeshSpec, serve_argv
from moemesh.launcher.ports import free_port

# Ignores SIGTERM and starts a grandchild; prints the grandchild's pid.
STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'])\n"
    "print(g.pid, flush=True)\n"
    "time.sleep(120)\n"
)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_for_line(path, timeout=30) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = path.read_text()
        if text.strip():
            return text.strip().splitlines()[0]
        time.sleep(0.05)
    raise TimeoutError(path)


def test_stop_all_escalates_to_sigkill_and_kills_the_group(tmp_path):
    child = Child("stubborn", [sys.executable, "-c", STUBBORN], tmp_path / "stubborn.log")
    grandchild = int(wait_for_line(tmp_path / "stubborn.log"))
    t0 = time.monotonic()
    stop_all([child], grace_s=0.5)
    assert time.monotonic() - t0 < 10
    assert child.poll() is not None
    deadline = time.monotonic() + 5
    while not gone(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gone(grandchild)


def test_children_die_with_a_killed_launcher(tmp_path):
    log = tmp_path / "inner.log"
    launcher = (
        "import sys, time\n"
        "from pathlib import Path\n"
        "from moemesh.launcher.child import Child\n"
        f"c = Child('sleeper', [sys.executable, '-c', 'import time; time.sleep(120)'], Path({str(log)!r}))\n"
        "print(c.pid, flush=True)\n"
        "time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, text=True)
    try:
        pid = int(proc.stdout.readline())
        assert not gone(pid)
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 5
        while not gone(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert gone(pid)
    finally:
        proc.kill()


def test_log_tail_shows_the_last_lines(tmp_path):
    child = Child("echo", [sys.executable, "-c", "print('\\n'.join(str(i) for i in range(50)))"], tmp_path / "echo.log")
    child.proc.wait(timeout=30)
    assert child.log_tail(3) == "47\n48\n49"
    stop_all([child], 1)


def test_starting_a_child_runs_no_fork_handlers(tmp_path):
    """A fork() would run gRPC core's fork handlers in the launcher (they can deadlock it with gRPC
    threads busy); children must start through vfork/posix_spawn, which run none."""
    calls = []
    os.register_at_fork(before=lambda: calls.append("before"), after_in_parent=lambda: calls.append("parent"))
    child = Child("quick", [sys.executable, "-c", "pass"], tmp_path / "quick.log")
    child.proc.wait(timeout=30)
    stop_all([child], 1)
    assert calls == []


def test_child_pid_is_the_program_pid_and_env_reaches_it(tmp_path):
    code = "import os; print(os.getpid(), os.environ['MOEMESH_PROBE'], flush=True)"
    child = Child("pid", [sys.executable, "-c", code], tmp_path / "pid.log", env={**os.environ, "MOEMESH_PROBE": "yes"})
    child.proc.wait(timeout=30)
    assert child.log_tail(1) == f"{child.pid} yes"
    assert child.proc.returncode == 0
    stop_all([child], 1)


def test_wait_serving_notices_an_exited_child():
    with pytest.raises(ChildExited):
        wait_serving(f"127.0.0.1:{free_port()}", timeout_s=30, alive=lambda: False)


def test_wait_serving_times_out():
    with pytest.raises(TimeoutError):
        wait_serving(f"127.0.0.1:{free_port()}", timeout_s=0.3)


def test_serve_argv_skips_unset_flags():
    argv = serve_argv("expert", {"model_dir": "/m", "experts_dtype": None, "control_addr": "h:1", "num_threads": ""})
    assert argv[1:] == ["-m", "moemesh.cli.main", "serve", "expert", "--model-dir", "/m", "--control-addr", "h:1"]


def test_serve_argv_writes_bools_as_switches():
    argv = serve_argv("attention", {"prefix_cache": False, "pack": True, "model_dir": "/m"})
    assert argv[5:] == ["--no-prefix-cache", "--pack", "--model-dir", "/m"]


@pytest.mark.parametrize("kw", [{"expert_servers": 0}, {"attention_replicas": 0}, {"transport": "tcp"}, {"port": 70000},
                                {"max_num_batched_tokens": -1}])
def test_mesh_spec_rejects_bad_values(kw):
    with pytest.raises(ValueError):
        MeshSpec(model_dir="/m", **kw)
