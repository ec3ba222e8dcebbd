"""Helpers for end-to-end tests: real service processes on loopback, `moemesh run --json` output."""
from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import grpc

from moemesh.launcher.child import Child, stop_all
from moemesh.launcher.health import wait_serving
from moemesh.launcher.mesh import serve_argv
from moemesh.launcher.ports import free_port
from moemesh.rpc.protos import load
from tests.fixtures.auth import TEST_RPC, channel, token_env

gen_pb, gen_grpc = load("generation")
att_pb, att_grpc = load("attention")


def start_service(service: str, log_dir: Path, name: str | None = None, **flags) -> tuple[Child, str]:
    """Starts `moemesh serve SERVICE` on a free loopback port and waits until it is SERVING."""
    port = free_port()
    child = Child(name or service, serve_argv(service, {"host": "127.0.0.1", "port": port, **flags}), log_dir / f"{name or service}.log",
                  env=token_env())
    address = f"127.0.0.1:{port}"
    try:
        wait_serving(address, 300, alive=lambda: child.poll() is None, rpc=TEST_RPC)
    except Exception:
        stop_all([child], 5)
        raise RuntimeError(f"{service} did not start:\n{child.log_tail(40)}")
    return child, address


def run_json(*args: str) -> dict:
    """`moemesh run ... --json` in this process; returns its JSON object."""
    from moemesh.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["run", *args, "--json"])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


def generate_json(address: str, *args: str) -> dict:
    """`moemesh generate --addr ADDRESS ... --json` in this process; returns its JSON object."""
    from moemesh.cli.main import main

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["generate", "--addr", address, *args, "--json"])
    assert rc == 0, out.getvalue()
    return json.loads(out.getvalue())


def attention_load(address: str, rpc=TEST_RPC):
    with channel(address, rpc) as ch:
        return att_grpc.AttentionStub(ch).GetLoad(att_pb.GetLoadRequest(), timeout=10)


def wait_idle(address: str, timeout_s: float = 10.0, rpc=TEST_RPC):
    """Polls an attention replica until no sequence runs or waits; returns the last load report."""
    import time

    deadline = time.monotonic() + timeout_s
    while True:
        load = attention_load(address, rpc)
        if (load.running == 0 and load.waiting == 0 and load.free_blocks == load.total_blocks) or time.monotonic() > deadline:
            return load
        time.sleep(0.05)


def assert_same_generation(got: dict, expected: dict, logprob_atol: float = 1e-4) -> None:
    """Two `--json` generations agree: ids, text and finish reason exactly; logprobs to float rounding.

    Logprobs are compared with a tolerance because float32 matmul results depend on the batch they are
    computed in (micro-batches, expert rows split over servers), which moves the last bits only.
    """
    import pytest

    for key in ("prompt_token_ids", "token_ids", "text", "finish_reason"):
        assert got[key] == expected[key], key
    assert got["logprobs"] == pytest.approx(expected["logprobs"], abs=logprob_atol)
    assert got["prompt_logprobs"][0] is None and expected["prompt_logprobs"][0] is None
    assert got["prompt_logprobs"][1:] == pytest.approx(expected["prompt_logprobs"][1:], abs=logprob_atol)
