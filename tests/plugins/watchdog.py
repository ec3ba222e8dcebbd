"""A hard per-test watchdog under pytest-timeout.

pytest-timeout (pyproject: `timeout`) fails a test that runs too long by raising from a SIGALRM
handler, and a Python signal handler cannot run while the main thread is stuck inside C code (a
deadlocked fork handler, a blocked native call). Then the run would hang until CI kills it, with
no clue where. This watchdog runs on faulthandler's own C thread: `grace` seconds after a test's
timeout it prints every thread's stack to the real stderr and ends the run with status 1.

MOEMESH_TEST_WATCHDOG_GRACE_S sets the grace (default 120 s).
"""
from __future__ import annotations

import faulthandler
import os
import sys

import pytest

DEFAULT_TIMEOUT_S = 300.0
DEFAULT_GRACE_S = 120.0


def pytest_configure(config: pytest.Config) -> None:
    # Output capture is suspended while plugins configure: this fd is the terminal's stderr.
    config._moemesh_watchdog_stream = os.fdopen(os.dup(sys.stderr.fileno()), "w")  # type: ignore[attr-defined]


def pytest_unconfigure(config: pytest.Config) -> None:
    faulthandler.cancel_dump_traceback_later()
    config._moemesh_watchdog_stream.close()  # type: ignore[attr-defined]


def hard_limit_s(item: pytest.Item) -> float:
    """The test's pytest-timeout limit (its marker, else the ini value) plus the grace."""
    marker = item.get_closest_marker("timeout")
    if marker is not None and marker.args:
        timeout = float(marker.args[0])
    else:
        timeout = float(item.config.getini("timeout") or DEFAULT_TIMEOUT_S)
    if timeout <= 0:
        timeout = DEFAULT_TIMEOUT_S
    return timeout + float(os.environ.get("MOEMESH_TEST_WATCHDOG_GRACE_S", DEFAULT_GRACE_S))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    stream = item.config._moemesh_watchdog_stream  # type: ignore[attr-defined]
    limit = hard_limit_s(item)
    faulthandler.dump_traceback_later(limit, exit=True, file=stream)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
