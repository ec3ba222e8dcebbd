"""`moemesh bench` against a running router + attention replica, side by side with the engine."""
from __future__ import annotations

import contextlib
import io
import json

import pytest

from moemesh.cli.main import main
from moemesh.launcher.child import stop_all
from tests.fixtures.services import start_service


@pytest.mark.slow  # a mesh of service processes
def test_bench_prints_summaries_ratio_and_plot(tiny_model_dir, tmp_path):
    att, att_addr = start_service("attention", tmp_path, model_dir=tiny_model_dir)
    router, router_addr = start_service("router", tmp_path, attention=att_addr)
    try:
        out = io.StringIO()
        plot = tmp_path / "bench.png"
        with contextlib.redirect_stdout(out):
            rc = main(["bench", "--addr", router_addr, "--model", str(tiny_model_dir), "--compare-engine",
                       "--num-requests", "6", "--concurrency", "3", "--prompt-len", "4", "--output-len", "5",
                       "--plot", str(plot), "--json"])
        assert rc == 0
        report = json.loads(out.getvalue())
    finally:
        stop_all([router, att], 10)
    mesh, engine = report["runs"]
    for run in (mesh, engine):
        assert run["requests"] == 6 and run["output_tokens"] == 30
        assert run["tokens_per_s"] > 0 and run["ttft_p99_ms"] >= run["ttft_p50_ms"] > 0
        assert run["tpot_p99_ms"] >= run["tpot_p50_ms"] > 0
    assert report["mesh_over_in_process"] > 0
    assert plot.stat().st_size > 1000


def test_poisson_arrivals_are_spread_out():
    from router_svc.loadgen import Workload

    arrivals = Workload(num_requests=50, rate=100.0).arrivals()
    assert arrivals[0] == 0 and all(b > a for a, b in zip(arrivals, arrivals[1:]))
    assert 0.2 < arrivals[-1] < 1.0  # ~49 gaps of 10 ms on average


def test_bad_workload_is_an_error(capsys):
    assert main(["bench", "--addr", "127.0.0.1:1", "--num-requests", "0"]) == 2
    assert "--num-requests must be in [1, " in capsys.readouterr().err
