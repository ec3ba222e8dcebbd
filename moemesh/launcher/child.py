"""`Child`: one supervised service process.

Each child runs in its own session (so its whole process group can be signalled) and asks the
kernel to SIGKILL it if the launcher dies (PR_SET_PDEATHSIG), so even a killed launcher leaves no
orphans. Output goes to a log file (appended to: a restarted child follows its predecessor) whose
tail is shown when the child fails.

The death signal is set by a tiny exec wrapper (`_PDEATHSIG_WRAPPER`), not by a `preexec_fn`: a
`preexec_fn` makes Python fork() the launcher, which runs gRPC core's fork handlers in a process
full of gRPC threads, and those can deadlock the launcher or the child. Without one, subprocess
uses vfork/posix_spawn, which runs no fork handlers. The wrapper keeps the pid (it execs), so
`Child.pid` is the service's own pid.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# argv: PARENT_PID PROGRAM ARGS...; asks for SIGKILL when the parent dies (PR_SET_PDEATHSIG = 1),
# exits if the parent already died before that, then execs PROGRAM in place.
_PDEATHSIG_WRAPPER = (
    "import ctypes, os, signal, sys\n"
    "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[2], sys.argv[2:])\n"
)


def with_parent_death_signal(argv: list[str]) -> list[str]:
    """`argv` run through the death-signal wrapper (Linux); unchanged elsewhere, where the
    process-group kill on shutdown still applies."""
    if not sys.platform.startswith("linux"):
        return list(argv)
    return [sys.executable, "-I", "-S", "-c", _PDEATHSIG_WRAPPER, str(os.getpid()), *argv]


class Child:
    def __init__(self, name: str, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self._log = open(log_path, "ab")  # a restarted child appends to its predecessor's log
        self.proc = subprocess.Popen(
            with_parent_death_signal(argv),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
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
