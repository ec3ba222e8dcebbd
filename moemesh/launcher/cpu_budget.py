"""Each expert server's own compute budget on one machine: a cgroup of its own with a CPU quota, or
pinned cores, so that a server holding hot experts is slowed by its own budget as a separate GPU or
node would be, not helped by cores its idle neighbours leave free.

    budgets = CpuBudgets.detect()            # what this machine allows, and why (`budgets.describe()`)
    slot = budgets.slot("expert-0", 0.5)     # a budget of 0.5 cores
    argv = slot.wrap(argv)                   # the child enters it before it execs (no race)
    threads = slot.threads                   # torch threads that fit the budget
    budgets.close()                          # removes the cgroups it made (once their children exited)

Modes, tried in this order:
  cgroup-v2   `cpu.max` = "QUOTA PERIOD" in a child cgroup of ours (or of the nearest ancestor that can
              enable the cpu controller for its children), on a unified hierarchy;
  cgroup-v1   `cpu.cfs_period_us` / `cpu.cfs_quota_us` in a child of our cgroup under the `cpu` controller;
  affinity    `os.sched_setaffinity`: each budget gets round(cores) cores of its own, in turn (budgets
              share cores only when there are more of them than cores);
  none        neither works here: the reason is in `describe()`, and the servers share every core.
The period is short by default (2 ms, longer where the quota would fall under the kernel's 1 ms
minimum), so a throttled server runs as a slower device would, in slices of a few milliseconds,
instead of running at full speed for most of 100 ms and then stalling for the rest. Short slices
have a price: a server starts each one after the other processes ran, with their data in the
caches, so the same call costs it more CPU the shorter its slices are (`bench/quota_call_cpu.py`
measures it by period); `slot(..., period_us=...)` sets a longer one.

A cgroup is entered by the child itself: `wrap` prefixes the command with a tiny program that writes
its own pid to the cgroup's `cgroup.procs` (or sets its affinity) and then execs the service, so the
service and every thread it starts run inside the budget from their first instruction.
Cgroups are named `moemesh-<launcher pid>-<name>`; ones left by a launcher that no longer runs are
removed when a new launcher makes its own.
"""
from __future__ import annotations

import errno
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")
MIN_QUOTA_US = 1000  # the kernel refuses a shorter quota
PERIOD_US = 2000  # the period, unless the quota would be shorter than MIN_QUOTA_US
MIN_PERIOD_US, MAX_PERIOD_US = 1000, 1_000_000  # the periods the kernel takes
STALE = re.compile(r"^moemesh-(\d+)-")

# argv: KIND ARG PROGRAM ARGS...; KIND "cgroup": ARG is a cgroup.procs file to write our pid to;
# KIND "cpus": ARG is a comma-separated core list for sched_setaffinity. Then execs PROGRAM in place.
_ENTER_WRAPPER = (
    "import os, sys\n"
    "kind, arg = sys.argv[1], sys.argv[2]\n"
    "try:\n"
    "    if kind == 'cgroup':\n"
    "        with open(arg, 'w') as f:\n"
    "            f.write(str(os.getpid()))\n"
    "    else:\n"
    "        os.sched_setaffinity(0, {int(c) for c in arg.split(',')})\n"
    "except OSError as e:\n"
    "    sys.stderr.write(f'moemesh: cannot enter the cpu budget ({kind} {arg}): {e}\\n')\n"
    "    os._exit(1)\n"
    "os.execvp(sys.argv[3], sys.argv[3:])\n"
)


def quota_us(cores: float, period_us: int = PERIOD_US) -> tuple[int, int]:
    """(quota, period) in microseconds for `cores` CPUs: the `period_us` period, lengthened so the
    quota is at least MIN_QUOTA_US."""
    period = max(period_us, math.ceil(MIN_QUOTA_US / cores))
    return max(MIN_QUOTA_US, round(cores * period)), period


def threads_for(cores: float) -> int:
    """Torch threads for a budget of `cores`: whole cores only (an OpenMP thread beyond the budget
    spin-waits for the others while the quota throttles them), at least one."""
    return max(1, math.floor(cores + 1e-9))


def check_cores(cores: float, name: str = "cores") -> float:
    if isinstance(cores, bool) or not isinstance(cores, (int, float)) or not math.isfinite(cores) or cores <= 0:
        raise ValueError(f"{name} must be a number of CPUs > 0, got {cores!r}")
    return float(cores)


def _remove_dir(path: Path) -> bool:
    """rmdir a cgroup (its control files go with it). A plain directory, as a test's fake tree is,
    has its files removed first. False when it still holds tasks or is gone."""
    try:
        os.rmdir(path)
        return True
    except FileNotFoundError:
        return False
    except OSError as e:
        if e.errno != errno.ENOTEMPTY:
            return False
    try:
        for f in path.iterdir():
            if f.is_file():
                f.unlink()
        os.rmdir(path)
        return True
    except OSError:
        return False


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class CpuSlot:
    """One server's budget. kind: "cgroup" (path: its cgroup), "affinity" (cpus: its cores) or "none"."""

    name: str
    cores: float
    kind: str
    path: Path | None = None
    cpus: tuple[int, ...] = ()
    period_us: int = 0  # the quota's period (cgroup kind)

    @property
    def threads(self) -> int | None:
        """Torch threads that fit the budget; None (the caller's default) without one."""
        if self.kind == "cgroup":
            return threads_for(self.cores)
        if self.kind == "affinity":
            return len(self.cpus)
        return None

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this budget (unchanged without one)."""
        if self.kind == "cgroup":
            return [sys.executable, "-I", "-S", "-c", _ENTER_WRAPPER, "cgroup", str(self.path / "cgroup.procs"), *argv]
        if self.kind == "affinity":
            return [sys.executable, "-I", "-S", "-c", _ENTER_WRAPPER, "cpus", ",".join(map(str, self.cpus)), *argv]
        return list(argv)

    def describe(self) -> str:
        if self.kind == "cgroup":
            return f"{self.name}: {self.cores:g} cores (cgroup {self.path}, period {self.period_us / 1000:g} ms, {self.threads} torch thread(s))"
        if self.kind == "affinity":
            return f"{self.name}: cores {','.join(map(str, self.cpus))} ({self.threads} torch thread(s))"
        return f"{self.name}: no budget of its own"


@dataclass
class CpuBudgets:
    """What this machine allows (`mode`, `why`) and the slots handed out so far."""

    mode: str  # "cgroup-v2" | "cgroup-v1" | "affinity" | "none"
    why: str  # how it was found, or why nothing better works
    parent: Path | None = None  # where the cgroups go (cgroup modes)
    available: tuple[int, ...] = ()  # cores this process may run on (affinity mode)
    slots: list[CpuSlot] = field(default_factory=list)
    _next_cpu: int = 0

    @classmethod
    def detect(
        cls,
        root: Path = CGROUP_ROOT,
        proc_self_cgroup: Path = PROC_SELF_CGROUP,
        available: Callable[[], set[int]] = lambda: os.sched_getaffinity(0),
        can_pin: Callable[[set[int]], None] | None = None,
    ) -> "CpuBudgets":
        """The best mode this machine allows. `can_pin(cpus)` checks that affinity can be set
        (default: set this thread's affinity to what it already is)."""
        reasons = []
        for mode, find in (("cgroup-v2", _find_v2), ("cgroup-v1", _find_v1)):
            parent, reason = find(Path(root), Path(proc_self_cgroup))
            if parent is not None:
                return cls(mode, f"{mode} cpu controller at {parent}", parent=parent)
            reasons.append(reason)
        try:
            cpus = set(available())
            (can_pin or (lambda c: os.sched_setaffinity(0, c)))(cpus)
            return cls("affinity", "cgroups are not usable here (" + "; ".join(reasons) + "): pinning cores instead",
                       available=tuple(sorted(cpus)))
        except (OSError, AttributeError) as e:
            reasons.append(f"sched_setaffinity: {e}")
        return cls("none", "; ".join(reasons))

    def describe(self) -> str:
        if self.mode == "none":
            return f"no cpu budget per server is possible here ({self.why}): the expert servers share every core"
        return self.why

    def slot(self, name: str, cores: float, period_us: int = PERIOD_US) -> CpuSlot:
        """A budget of `cores` CPUs for child `name`; `period_us`: the quota's period (cgroup modes;
        lengthened where the quota would fall under the kernel's minimum)."""
        cores = check_cores(cores)
        if isinstance(period_us, bool) or not isinstance(period_us, int) or not MIN_PERIOD_US <= period_us <= MAX_PERIOD_US:
            raise ValueError(f"period_us must be an int in [{MIN_PERIOD_US}, {MAX_PERIOD_US}], got {period_us!r}")
        if self.mode in ("cgroup-v1", "cgroup-v2"):
            if not self.slots:
                self._remove_stale()
            path = self.parent / f"moemesh-{os.getpid()}-{name}"
            path.mkdir(exist_ok=True)
            quota, period = quota_us(cores, period_us)
            _write_quota(path, self.mode, quota, period)
            s = CpuSlot(name, cores, "cgroup", path=path, period_us=period)
        elif self.mode == "affinity":
            n = min(len(self.available), max(1, round(cores)))
            cpus = tuple(sorted(self.available[(self._next_cpu + i) % len(self.available)] for i in range(n)))
            self._next_cpu = (self._next_cpu + n) % len(self.available)
            s = CpuSlot(name, cores, "affinity", cpus=cpus)
        else:
            s = CpuSlot(name, cores, "none")
        self.slots.append(s)
        return s

    def shared_cores(self) -> bool:
        """Whether pinned budgets had to share cores (more budgets than cores)."""
        used = [c for s in self.slots for c in s.cpus]
        return len(used) != len(set(used))

    def _remove_stale(self) -> None:
        for d in self.parent.iterdir():
            m = STALE.match(d.name)
            if d.is_dir() and m and int(m.group(1)) != os.getpid() and not _pid_alive(int(m.group(1))):
                _remove_dir(d)

    def close(self, timeout_s: float = 5.0) -> list[Path]:
        """Remove the cgroups made here (retrying while their tasks exit); returns those left."""
        left = [s.path for s in self.slots if s.path is not None]
        deadline = time.monotonic() + timeout_s
        while left:
            left = [p for p in left if p.exists() and not _remove_dir(p)]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        self.slots = [s for s in self.slots if s.path in left]
        return left


def _write_quota(path: Path, mode: str, quota: int, period: int) -> None:
    if mode == "cgroup-v2":
        (path / "cpu.max").write_text(f"{quota} {period}\n")
        return
    # the period first: the quota is checked against it
    (path / "cpu.cfs_period_us").write_text(f"{period}\n")
    (path / "cpu.cfs_quota_us").write_text(f"{quota}\n")


def _read_quota(path: Path, mode: str) -> tuple[int, int]:
    if mode == "cgroup-v2":
        quota, period = (path / "cpu.max").read_text().split()
        return int(quota), int(period)
    return int((path / "cpu.cfs_quota_us").read_text()), int((path / "cpu.cfs_period_us").read_text())


def _probe(parent: Path, mode: str) -> str | None:
    """None when a child cgroup under `parent` takes a quota (made, written, read back, removed),
    else why not."""
    probe = parent / f"moemesh-{os.getpid()}-probe"
    try:
        probe.mkdir(exist_ok=True)
        quota, period = quota_us(0.5)
        _write_quota(probe, mode, quota, period)
        if _read_quota(probe, mode) != (quota, period):
            return f"{probe}: the quota written does not read back"
        return None
    except (OSError, ValueError) as e:
        return f"{probe}: {e}"
    finally:
        _remove_dir(probe)


def _own_path(proc_self_cgroup: Path, want: Callable[[str, str], bool]) -> str | None:
    """Our cgroup's path from /proc/self/cgroup, on the line whose (id, controllers) `want` accepts."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3 and want(parts[0], parts[1]):
            return parts[2]
    return None


def _find_v2(root: Path, proc_self_cgroup: Path) -> tuple[Path | None, str]:
    controllers = root / "cgroup.controllers"
    if not controllers.is_file():
        return None, f"cgroup v2: no unified hierarchy at {root}"
    if "cpu" not in controllers.read_text().split():
        return None, f"cgroup v2: the cpu controller is not available at {root}"
    own = _own_path(proc_self_cgroup, lambda hid, ctl: hid == "0" and ctl == "")
    path = root / (own or "/").lstrip("/")
    reason = f"cgroup v2: no cgroup from {path} up to {root} can give children the cpu controller"
    while True:  # a cgroup holding processes (not the root) cannot hand controllers down: try ancestors
        sub = path / "cgroup.subtree_control"
        try:
            if "cpu" not in sub.read_text().split():
                sub.write_text("+cpu\n")
            why = _probe(path, "cgroup-v2")
            if why is None:
                return path, ""
            reason = f"cgroup v2: {why}"
        except OSError as e:
            reason = f"cgroup v2: {sub}: {e}"
        if path == root:
            return None, reason
        path = path.parent


def _find_v1(root: Path, proc_self_cgroup: Path) -> tuple[Path | None, str]:
    mounts = [d for d in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu") if (d / "cpu.cfs_quota_us").is_file()]
    if not mounts:
        return None, f"cgroup v1: no cpu controller mounted under {root}"
    own = _own_path(proc_self_cgroup, lambda hid, ctl: "cpu" in ctl.split(","))
    parent = mounts[0] / (own or "/").lstrip("/")
    why = _probe(parent, "cgroup-v1")
    return (parent, "") if why is None else (None, f"cgroup v1: {why}")
