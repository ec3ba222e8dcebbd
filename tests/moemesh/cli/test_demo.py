"""`moemesh demo`: builds the demo model if absent, brings the mesh up, streams a coherent answer
to the fixed question, shuts everything down (the README's first command)."""
from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

pytestmark = pytest.mark.slow  # `moemesh demo` as a process: the demo model and a mesh


def test_demo_streams_an_answer_and_leaves_nothing_running():
    before = {p.pid for p in psutil.process_iter()}
    out = subprocess.run([sys.executable, "-m", "moemesh.cli.main", "demo", "--max-new-tokens", "24"],
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "assistant:" in out.stdout
    assert "Paris" in out.stdout
    orphans = [p for p in psutil.process_iter(["cmdline", "ppid"]) if p.pid not in before and p.info["ppid"] in (0, 1)
               and "moemesh.cli.main" in (p.info["cmdline"] or []) and "serve" in (p.info["cmdline"] or [])]
    assert not orphans
