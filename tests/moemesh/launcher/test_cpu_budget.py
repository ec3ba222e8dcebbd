"""`CpuBudgets`: each expert server's compute budget, on fake sysfs trees (cgroup v1, v2, neither) and,
where this machine allows it, on the real one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from moemesh.launcher.cpu_budget import CpuBudgets, check_cores, quota_us, threads_for


def no_pinning(cpus):
    raise OSError("sched_setaffinity is not permitted")


def v1_tree(tmp_path: Path, own: str = "/", mount: str = "cpu") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    ctl = root / mount / own.lstrip("/")
    ctl.mkdir(parents=True)
    (root / mount / "cpu.cfs_quota_us").write_text("-1\n")
    (root / mount / "cpu.cfs_period_us").write_text("100000\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text(f"4:memory:/x\n2:{mount}:{own}\n0::/\n")
    return root, proc


def v2_tree(tmp_path: Path, controllers: str = "cpuset cpu io memory pids") -> tuple[Path, Path]:
    root = tmp_path / "cgroup"
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("memory\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/\n")
    return root, proc


def test_quota_and_threads_follow_the_cores():
    assert quota_us(0.25) == (1000, 4000)  # the kernel's 1 ms minimum quota stretches the period
    assert quota_us(0.5) == (1000, 2000)
    assert quota_us(2) == (4000, 2000)
    assert quota_us(0.1) == (1000, 10000)
    assert quota_us(0.1, 50000) == (5000, 50000) and quota_us(0.1, 5000) == (1000, 10000)  # a longer period asked for; never under 1 ms
    assert [threads_for(c) for c in (0.25, 1, 1.5, 2, 3.99)] == [1, 1, 1, 2, 3]
    for bad in (0, -1, float("nan"), True, "1"):
        with pytest.raises(ValueError, match="cores"):
            check_cores(bad)


def test_cgroup_v1_gives_each_server_a_cgroup_with_its_quota(tmp_path):
    root, proc = v1_tree(tmp_path, own="/user.slice/me", mount="cpu,cpuacct")
    b = CpuBudgets.detect(root, proc, can_pin=no_pinning)
    parent = root / "cpu,cpuacct" / "user.slice" / "me"
    assert (b.mode, b.parent) == ("cgroup-v1", parent)
    assert list(parent.iterdir()) == []  # the probe cgroup is gone
    s = b.slot("expert-0", 0.25)
    assert s.path == parent / f"moemesh-{os.getpid()}-expert-0"
    assert (s.path / "cpu.cfs_quota_us").read_text().strip() == "1000"
    assert (s.path / "cpu.cfs_period_us").read_text().strip() == "4000"
    assert s.threads == 1
    argv = s.wrap(["prog", "--flag"])
    assert argv[-2:] == ["prog", "--flag"] and str(s.path / "cgroup.procs") in argv
    assert "expert-0: 0.25 cores" in s.describe() and "period 4 ms" in s.describe()
    longer = b.slot("expert-1", 0.25, period_us=100_000)
    assert (longer.path / "cpu.cfs_quota_us").read_text().strip() == "25000"
    assert (longer.path / "cpu.cfs_period_us").read_text().strip() == "100000"
    for bad in (999, 1_000_001, 2.5e4):
        with pytest.raises(ValueError, match="period_us"):
            b.slot("expert-2", 0.25, period_us=bad)
    assert b.close() == [] and not s.path.exists() and not longer.path.exists()


def test_cgroup_v2_enables_the_cpu_controller_and_writes_cpu_max(tmp_path):
    root, proc = v2_tree(tmp_path)
    b = CpuBudgets.detect(root, proc, can_pin=no_pinning)
    assert (b.mode, b.parent) == ("cgroup-v2", root)
    assert "+cpu" in (root / "cgroup.subtree_control").read_text()
    s = b.slot("expert-1", 2)
    assert (s.path / "cpu.max").read_text().split() == ["4000", "2000"]
    assert s.threads == 2
    b.close()
    assert not s.path.exists()


def test_without_cgroups_each_server_gets_cores_of_its_own_then_shares(tmp_path):
    root = tmp_path / "nothing"
    root.mkdir()
    pinned = []
    b = CpuBudgets.detect(root, tmp_path / "no-proc-file", available=lambda: {0, 1, 2}, can_pin=pinned.append)
    assert b.mode == "affinity" and pinned == [{0, 1, 2}]
    assert "cgroup v1: no cpu controller" in b.describe() and "pinning cores" in b.describe()
    slots = [b.slot(f"expert-{i}", c) for i, c in enumerate((1, 0.3, 1))]
    assert [s.cpus for s in slots] == [(0,), (1,), (2,)] and not b.shared_cores()
    assert [s.threads for s in slots] == [1, 1, 1]
    assert b.slot("expert-3", 2).cpus == (0, 1) and b.shared_cores()
    assert slots[0].wrap(["prog"])[-3:] == ["cpus", "0", "prog"]


def test_neither_is_a_clear_message_and_no_budget(tmp_path):
    root, proc = v2_tree(tmp_path, controllers="memory io")
    b = CpuBudgets.detect(root, proc, can_pin=no_pinning)
    assert b.mode == "none"
    text = b.describe()
    assert "no cpu budget per server is possible here" in text
    assert "cpu controller is not available" in text and "sched_setaffinity is not permitted" in text
    s = b.slot("expert-0", 1)
    assert (s.kind, s.threads, s.wrap(["prog"])) == ("none", None, ["prog"])


def test_an_unwritable_cgroup_falls_back(tmp_path):
    root, proc = v1_tree(tmp_path)
    proc.write_text("2:cpu:/not/there\n")  # our cgroup's directory is missing: no child can be made
    b = CpuBudgets.detect(root, proc, available=lambda: {0}, can_pin=lambda c: None)
    assert b.mode == "affinity" and "cgroup v1:" in b.describe()


def test_cgroups_of_a_dead_launcher_are_removed(tmp_path):
    root, proc = v1_tree(tmp_path)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = root / "cpu" / f"moemesh-{dead.pid}-expert-0"
    stale.mkdir()
    (stale / "cpu.cfs_quota_us").write_text("1000\n")
    mine = root / "cpu" / "someone-else"
    mine.mkdir()
    b = CpuBudgets.detect(root, proc, can_pin=no_pinning)
    b.slot("expert-0", 1)
    assert not stale.exists() and mine.exists()
    b.close()


def test_a_pinned_child_runs_on_its_cores(tmp_path):
    cpu = min(os.sched_getaffinity(0))
    b = CpuBudgets.detect(tmp_path, tmp_path / "none", available=lambda: {cpu})
    s = b.slot("child", 1)
    out = subprocess.run(s.wrap([sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]),
                         capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == f"[{cpu}]", out.stderr


@pytest.mark.skipif(CpuBudgets.detect().mode not in ("cgroup-v1", "cgroup-v2"), reason="no writable cgroup cpu controller here")
def test_a_real_cgroup_caps_a_busy_child():
    b = CpuBudgets.detect()
    s = b.slot("busy", 0.25)
    busy = ("import time\nt, c = time.monotonic(), time.process_time()\n"
            "while time.monotonic() - t < 1.0: pass\nprint((time.process_time() - c) / (time.monotonic() - t))")
    try:
        out = subprocess.run(s.wrap([sys.executable, "-c", busy]), capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        assert float(out.stdout) < 0.4  # at most its quarter of a core, however idle the machine
    finally:
        deadline = time.monotonic() + 5
        while b.close(0.5) and time.monotonic() < deadline:
            pass
    assert not s.path.exists()
