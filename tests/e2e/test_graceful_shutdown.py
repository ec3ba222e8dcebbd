"""SIGTERM drains a service: health turns NOT_SERVING, new requests get UNAVAILABLE, streams in
flight run to completion within the grace period, and the process exits cleanly."""
from __future__ import annotations

import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from moemesh.launcher.child import stop_all
from moemesh.rpc.generation import build_request
from tests.fixtures.services import attention_load, gen_grpc, start_service

LONG = dict(max_new_tokens=250, temperature=0.0, ignore_eos=True)
STREAMS = 24  # enough work that the streams are still running when the signal lands


@pytest.fixture
def services(tiny_model_dir, tmp_path):
    children = []
    att, att_addr = start_service("attention", tmp_path, model_dir=tiny_model_dir, shutdown_grace_s=60, kv_cache_tokens=16384)
    children.append(att)
    router, router_addr = start_service("router", tmp_path, attention=att_addr, shutdown_grace_s=60)
    children.append(router)
    yield {"attention": (att, att_addr), "router": (router, router_addr)}
    stop_all(children, 10)


def health(address: str):
    with grpc.insecure_channel(address) as ch:
        try:
            return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status
        except grpc.RpcError as e:
            return e.code()


def refused(address: str) -> grpc.StatusCode | None:
    """The status a new Generate gets (None if it was served)."""
    with grpc.insecure_channel(address) as ch:
        try:
            list(gen_grpc.GenerationStub(ch).Generate(build_request(prompt_token_ids=[5], max_new_tokens=1), timeout=5))
            return None
        except grpc.RpcError as e:
            return e.code()


@pytest.mark.parametrize("target", ["router", "attention"])
def test_sigterm_drains_in_flight_streams(services, target):
    try:
        check_drain(services, target)
    except (AssertionError, grpc.RpcError) as e:  # the services' own account, for a failure seen once under load
        logs = "\n".join(f"--- {name} log tail:\n{child.log_tail(30)}" for name, (child, _) in services.items())
        raise AssertionError(f"{e}\n{logs}") from e


def check_drain(services, target):
    child, address = services[target]
    _, router_addr = services["router"]
    _, att_addr = services["attention"]
    assert health(address) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(router_addr) as ch:
        stub = gen_grpc.GenerationStub(ch)
        streams = [stub.Generate(build_request(prompt_token_ids=[5 + i, 6, 7], **LONG), timeout=300) for i in range(STREAMS)]
        firsts = [next(s) for s in streams]
        if target == "router":  # the attention replica is still working on them
            load = attention_load(att_addr)
            assert load.running + load.waiting > 0
        child.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        assert health(address) in (health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
        assert refused(router_addr) == grpc.StatusCode.UNAVAILABLE
        rests = [list(s) for s in streams]
    for first, rest in zip(firsts, rests):
        assert len([t for r in [first, *rest] for t in r.token_ids]) == LONG["max_new_tokens"]
        assert rest[-1].finish_reason == "length"
    assert child.proc.wait(timeout=60) == 0
