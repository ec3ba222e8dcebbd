"""How many CPUs this process may use: its cgroup's CPU quota (v2 `cpu.max`, v1 `cpu.cfs_quota_us` /
`cpu.cfs_period_us`, the tightest of its cgroup and their ancestors) or the cores it is pinned to,
whichever is less; None when neither limits it. An expert server reports it, so the control plane's
cost model knows the budget its CPU demand is held to."""
from __future__ import annotations

import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_SELF_CGROUP = Path("/proc/self/cgroup")


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _tightest(directory: Path, top: Path, read) -> float | None:
    limits = []
    while True:
        value = read(directory)
        if value is not None:
            limits.append(value)
        if directory == top or top not in directory.parents:
            return min(limits, default=None)
        directory = directory.parent


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPU quota of this process's cgroup (and its ancestors), in CPUs; None without one."""
    try:
        lines = proc_self_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hid, controllers, path = parts
        if hid == "0" and controllers == "" and (root / "cgroup.controllers").is_file():
            limits.append(_tightest(root / path.lstrip("/"), root, _v2_limit))
        elif "cpu" in controllers.split(","):
            for mount in (root / "cpu", root / "cpu,cpuacct", root / "cpuacct,cpu"):
                if mount.is_dir():
                    limits.append(_tightest(mount / path.lstrip("/"), mount, _v1_limit))
                    break
    return min((v for v in limits if v is not None), default=None)


def cpu_limit(root: Path = CGROUP_ROOT, proc_self_cgroup: Path = PROC_SELF_CGROUP) -> float | None:
    """The CPUs this process may use (cgroup quota or pinned cores, the lesser); None when neither
    is below this machine's core count."""
    limits = [cgroup_cpu_limit(root, proc_self_cgroup)]
    try:
        pinned = len(os.sched_getaffinity(0))
        if pinned < (os.cpu_count() or pinned + 1):
            limits.append(float(pinned))
    except (AttributeError, OSError):
        pass
    return min((v for v in limits if v is not None), default=None)
