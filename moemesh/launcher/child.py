"""`Child`: one supervised service process.

Each child runs in its own session (so its whole process group can be signalled) and asks the
kernel to SIGKILL it if the launcher dies (PR_SET_PDEATHSIG), so even a killed launcher leaves no
orphans. Output goes to a log file whose tail is shown when the child fails.
"""
from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import time
from pathlib import Path

PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:  # not Linux: the process group kill on shutdown still applies
        pass


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_die_with_parent,
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 20) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def close(self) -> None:
        self._log.close()


def stop_all(children: list[Child], grace_s: float) -> None:
    """SIGTERM every child's process group, wait up to `grace_s`, then SIGKILL what is left."""
    for c in children:
        if c.poll() is None:
            c.signal_group(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for c in children:
        remaining = max(0.0, deadline - time.monotonic())
        try:
            c.proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            pass
    for c in children:
        c.signal_group(signal.SIGKILL)  # also reaps grandchildren left in the group
        try:
            c.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        c.close()
