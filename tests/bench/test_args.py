"""Argument parsing of the benchmarks (their runs are the lead's, on a quiet machine)."""
from __future__ import annotations

from pathlib import Path

import pytest

from bench import engine_vs_llamacpp, engine_vs_transformers, gateway_overhead, gateway_vs_router, mesh_vs_engine, step_cost


def test_engine_vs_transformers_defaults_and_lists():
    cfg = engine_vs_transformers.parse_args([])
    assert cfg.shape == "demo" and cfg.model is None
    assert cfg.dtypes == ("float32", "bfloat16") and cfg.experts_dtypes == ("bf16", "fp8", "mxfp4", "nvfp4")
    assert (cfg.concurrent, cfg.threads, cfg.pack_experts, cfg.all_experts_path) == (16, 2, None, True)  # 2 threads, as the llama.cpp anchor
    assert engine_vs_transformers.parse_args(["--no-all-experts-path"]).all_experts_path is False
    cfg = engine_vs_transformers.parse_args(["--shape", "qwen3-sparse", "--dtypes", "bfloat16", "--experts-dtypes", "",
                                             "--pack-experts", "off", "--new-tokens", "8"])
    assert (cfg.shape, cfg.dtypes, cfg.experts_dtypes, cfg.pack_experts, cfg.new_tokens) == ("qwen3-sparse", ("bfloat16",), (), False, 8)
    assert engine_vs_transformers.parse_args(["--experts-dtypes", "mxfp4, nvfp4"]).experts_dtypes == ("mxfp4", "nvfp4")


@pytest.mark.parametrize("argv, message", [
    (["--shape", "llama"], "invalid choice"),
    (["--dtypes", "float16"], "unknown value 'float16'"),
    (["--experts-dtypes", "int4"], "unknown value 'int4'"),
    (["--new-tokens", "1"], "--new-tokens must be >= 2"),
    (["--concurrent", "0"], "--concurrent must be >= 1"),
])
def test_engine_vs_transformers_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        engine_vs_transformers.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_mesh_vs_engine_defaults_and_lists():
    ns = mesh_vs_engine.parse_args([])
    assert (ns.shape, ns.concurrency, ns.requests_per_stream, ns.transports, ns.expert_servers) == ("demo", (1, 16), 2, ("grpc", "dist"), 2)
    assert ns.all_experts_path is True and mesh_vs_engine.parse_args(["--no-all-experts-path"]).all_experts_path is False
    ns = mesh_vs_engine.parse_args(["--shape", "qwen3-sparse", "--concurrency", "16", "--transports", "grpc", "--json"])
    assert (ns.shape, ns.concurrency, ns.transports, ns.json) == ("qwen3-sparse", (16,), ("grpc",), True)


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0,16"], "integers >= 1"),
    (["--concurrency", "a"], "comma-separated integers"),
    (["--transports", "tcp"], "--transports"),
    (["--rounds", "0"], "--rounds >= 1"),
    (["--shape", "nope"], "invalid choice"),
])
def test_mesh_vs_engine_rejects(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        mesh_vs_engine.parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_engine_vs_llamacpp_args(tmp_path, capsys):
    a = engine_vs_llamacpp.parse_args([])
    assert (a.shape, a.threads, a.llama_4bit, a.sdist, a.new_tokens) == ("qwen3-sparse", 2, "mxfp4", None, 64)
    sdist = tmp_path / "llama_cpp_python-0.0.0.tar.gz"
    sdist.write_bytes(b"")
    a = engine_vs_llamacpp.parse_args(["--llama-4bit", "q4_0", "--sdist", str(sdist), "--shape", "qwen3-sparse-tiny"])
    assert (a.llama_4bit, a.sdist, a.shape) == ("q4_0", Path(sdist), "qwen3-sparse-tiny")
    for argv, message in ((["--sdist", str(tmp_path / "missing.tar.gz")], "no such file"), (["--llama-4bit", "q8_0"], "invalid choice"),
                          (["--threads", "0"], "--threads >= 1")):
        with pytest.raises(SystemExit):
            engine_vs_llamacpp.parse_args(argv)
        assert message in capsys.readouterr().err


def test_gateway_vs_router_defaults_and_rejects(capsys):
    ns = gateway_vs_router.parse_args([])
    assert (ns.shape, ns.model, ns.concurrency, ns.rounds, ns.expert_servers) == ("demo", None, 16, 3, 2)
    assert gateway_vs_router.parse_args(["--shape", "qwen3-sparse", "--rounds", "1"]).shape == "qwen3-sparse"
    with pytest.raises(SystemExit) as e:
        gateway_vs_router.parse_args(["--rounds", "0"])
    assert e.value.code == 2 and "--rounds >= 1" in capsys.readouterr().err


def test_gateway_overhead_defaults_and_rejects(capsys):
    ns = gateway_overhead.parse_args([])
    assert (ns.concurrency, ns.num_requests, ns.output_len, ns.step_ms, ns.rounds) == (16, 64, 64, 20.0, 3)
    for argv, message in ((["--output-len", "1"], "--output-len >= 2"), (["--prompt-len", "4"], "--prompt-len >= 8")):
        with pytest.raises(SystemExit) as e:
            gateway_overhead.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_rebalance_defaults_and_rejects(capsys):
    from bench import rebalance

    ns = rebalance.parse_args([])
    assert (ns.shape, ns.expert_servers, ns.expert_cpu_quota, ns.top_k, ns.top_k_phases, ns.json) == (
        "qwen3-sparse-skew", 4, 0.1, 2, (8, 4, 8), False)
    assert ns.expert_cpu_period_ms is None and rebalance.parse_args(["--expert-cpu-period-ms", "50"]).expert_cpu_period_ms == 50.0
    ns = rebalance.parse_args(["--shape", "demo", "--top-k-phases", "", "--expert-cpu-quota", "0", "--transport", "dist", "--json"])
    assert (ns.shape, ns.top_k_phases, ns.expert_cpu_quota, ns.transport, ns.json) == ("demo", (), 0.0, "dist", True)
    for argv, message in ((["--top-k-phases", "8,0"], "integers >= 1"), (["--phase-s", "0"], "--phase-s > 0"),
                          (["--expert-cpu-quota", "-1"], "--expert-cpu-quota"), (["--concurrency", "0"], "--concurrency"),
                          (["--expert-cpu-period-ms", "0.5"], "--expert-cpu-period-ms")):
        with pytest.raises(SystemExit) as e:
            rebalance.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_step_cost_defaults_and_rejects(capsys):
    ns = step_cost.parse_args([])
    assert (ns.shape, ns.model, ns.dtype, ns.concurrent, ns.steps, ns.threads, ns.top) == ("demo", None, "bfloat16", 16, 20, 1, 0)
    for argv, message in ((["--concurrent", "0"], "need --concurrent"), (["--top", "-1"], "need --concurrent"), (["--dtype", "float16"], "invalid choice")):
        with pytest.raises(SystemExit) as e:
            step_cost.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_quota_call_cpu_defaults_and_rejects(capsys):
    from bench import quota_call_cpu

    ns = quota_call_cpu.parse_args([])
    assert (ns.shape, ns.cores, ns.periods_ms, ns.experts_per_call, ns.rounds, ns.json) == (
        "qwen3-sparse-tiny-skew", 0.1, (10, 20, 50, 100), (4,), 2, False)
    assert quota_call_cpu.parse_args(["--periods-ms", "20, 200", "--cores", "0.5"]).periods_ms == (20, 200)
    for argv, message in ((["--cores", "1"], "0 < --cores < 1"), (["--periods-ms", "5"], "at least 1 ms"),
                          (["--periods-ms", "0"], "integers >= 1"), (["--rounds", "0"], "--rounds >= 1"),
                          (["--experts-per-call", "1,8"], "--experts-per-call")):
        with pytest.raises(SystemExit) as e:
            quota_call_cpu.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err


def test_the_shared_integer_list_types():
    import argparse

    from bench.args import positive_ints, positive_ints_or_none

    assert positive_ints("1, 16") == (1, 16) and positive_ints_or_none("8,4,8") == (8, 4, 8)
    assert positive_ints_or_none("") == ()
    for bad in ("", "0,4", "a"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints(bad)
    for bad in ("0", "x,1"):
        with pytest.raises(argparse.ArgumentTypeError):
            positive_ints_or_none(bad)
