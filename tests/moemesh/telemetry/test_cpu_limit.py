"""`cpu_limit`: the CPUs a process may use, read from fake cgroup trees (v1, v2, nested limits)."""
import os
from pathlib import Path

import pytest

from moemesh.telemetry.cpu_limit import cgroup_cpu_limit, cpu_limit


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v1_quota_of_the_tightest_of_the_cgroup_and_its_ancestors(tmp_path):
    root = tmp_path / "cg"
    write(root / "cpu,cpuacct" / "cpu.cfs_quota_us", "-1\n")
    write(root / "cpu,cpuacct" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "pod" / "cpu.cfs_quota_us", "150000\n")  # the pod: 1.5 CPUs
    write(root / "cpu,cpuacct" / "pod" / "cpu.cfs_period_us", "100000\n")
    write(root / "cpu,cpuacct" / "pod" / "server" / "cpu.cfs_quota_us", "1000\n")  # the server: 0.25
    write(root / "cpu,cpuacct" / "pod" / "server" / "cpu.cfs_period_us", "4000\n")
    proc = tmp_path / "proc"
    proc.write_text("5:memory:/x\n3:cpu,cpuacct:/pod/server\n")
    assert cgroup_cpu_limit(root, proc) == 0.25
    proc.write_text("3:cpu,cpuacct:/pod\n")
    assert cgroup_cpu_limit(root, proc) == 1.5


def test_v2_cpu_max(tmp_path):
    root = tmp_path / "cg"
    write(root / "cgroup.controllers", "cpu memory\n")
    write(root / "a" / "cpu.max", "max 100000\n")
    write(root / "a" / "b" / "cpu.max", "50000 100000\n")
    proc = tmp_path / "proc"
    proc.write_text("0::/a/b\n")
    assert cgroup_cpu_limit(root, proc) == 0.5
    proc.write_text("0::/a\n")
    assert cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_is_no_limit(tmp_path):
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None
    if len(os.sched_getaffinity(0)) == os.cpu_count():
        assert cpu_limit(tmp_path, tmp_path / "missing") is None


@pytest.mark.skipif(os.cpu_count() < 2, reason="one core: pinning cannot narrow it")
def test_pinned_cores_are_a_limit(tmp_path):
    import subprocess
    import sys

    cpu = min(os.sched_getaffinity(0))
    code = "import os, sys; os.sched_setaffinity(0, {%d}); from moemesh.telemetry.cpu_limit import cpu_limit; from pathlib import Path; print(cpu_limit(Path(sys.argv[1]), Path(sys.argv[2])))" % cpu
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path), str(tmp_path / "missing")], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "1.0", out.stderr
