import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

HANGS = """
import signal, time

def test_hangs_where_no_signal_handler_runs():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})  # pytest-timeout's alarm never lands
    time.sleep(120)
"""

QUICK = """
def test_quick():
    pass
"""


def run_pytest(tmp_path: Path, source: str) -> tuple[subprocess.CompletedProcess, float]:
    test_file = tmp_path / "test_case.py"
    test_file.write_text(source)
    env = {**os.environ, "MOEMESH_TEST_WATCHDOG_GRACE_S": "1"}
    t0 = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "tests.plugins.watchdog", "-p", "no:cacheprovider", "-q",
         "-o", "timeout=1", str(test_file)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=100)
    return proc, time.monotonic() - t0


@pytest.mark.slow  # pytest as a process
def test_a_test_stuck_past_its_timeout_dumps_stacks_and_ends_the_run(tmp_path):
    proc, took = run_pytest(tmp_path, HANGS)
    assert proc.returncode != 0
    assert took < 60  # not the 120 s sleep
    assert "test_hangs_where_no_signal_handler_runs" in proc.stderr  # the stack names the stuck test
    assert "Timeout" in proc.stderr


@pytest.mark.slow  # pytest as a process
def test_quick_tests_are_not_disturbed(tmp_path):
    proc, _ = run_pytest(tmp_path, QUICK)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout
