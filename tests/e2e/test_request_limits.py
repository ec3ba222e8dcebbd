"""A 100 MB request against a live router (attention replica with its experts in process, both real
processes): refused at once, without memory growth, while another client's streams keep flowing.

The router's max receive size is derived from the model's context (router_svc/limits.py), so gRPC
refuses such a message from its length prefix (RESOURCE_EXHAUSTED) before reading it; a request
within that size whose text exceeds the text bound is OUT_OF_RANGE naming the field, before it is
tokenized."""
from __future__ import annotations

import threading
import time

import grpc
import psutil
import pytest

from moemesh.launcher.child import stop_all
from moemesh.tokenizer import Tokenizer
from moemesh.rpc.generation import build_request
from router_svc.limits import RequestLimits
from tests.fixtures.services import gen_grpc, gen_pb, start_service

MB = 1 << 20


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b, x = x & 0x7F, x >> 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


def field(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


@pytest.fixture(scope="module")
def mesh(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    children = []
    try:
        att, att_addr = start_service("attention", logs, model_dir=tiny_model_dir, kv_cache_tokens=2048)
        children.append(att)
        router, router_addr = start_service("router", logs, attention=att_addr)
        children.append(router)
        yield {"router": router_addr, "router_pid": router.proc.pid}
    finally:
        stop_all(children, 10)


class Flow:
    """Back-to-back greedy streams in a thread; records the longest wait for any next message."""

    def __init__(self, address: str):
        self.address = address
        self.gaps: list[float] = []
        self.errors: list[str] = []
        self.streams = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        while not self.gaps and not self.errors:
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(60)

    def _run(self):
        with grpc.insecure_channel(self.address) as ch:
            stub = gen_grpc.GenerationStub(ch)
            last = time.perf_counter()
            while not self._stop.is_set():
                req = build_request(prompt_token_ids=[5, 6, 7], max_new_tokens=40, temperature=0.0, ignore_eos=True)
                try:
                    for _ in stub.Generate(req, timeout=60):
                        now = time.perf_counter()
                        self.gaps.append(now - last)
                        last = now
                    self.streams += 1
                except grpc.RpcError as e:
                    self.errors.append(f"{e.code().name}: {e.details()}")


class Rss:
    """The highest resident memory of a process while the body runs, sampled every 5 ms."""

    def __init__(self, pid: int):
        self.proc = psutil.Process(pid)
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            time.sleep(0.005)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        time.sleep(0.2)
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.proc.memory_info().rss)

    @property
    def growth_mb(self) -> float:
        return (self.peak - self.base) / MB


def send_raw(address: str, raw: bytes, timeout: float = 30):
    with grpc.insecure_channel(address) as ch:
        call = ch.unary_stream("/moemesh.v1.Generation/Generate", request_serializer=None,
                               response_deserializer=gen_pb.GenerateResponse.FromString)
        started = time.perf_counter()
        with pytest.raises(grpc.RpcError) as e:
            list(call(raw, timeout=timeout))
        return e.value, time.perf_counter() - started


@pytest.mark.parametrize("kind", ["text", "token_ids"])
def test_a_100_mb_prompt_is_refused_at_once_without_memory_growth_while_streams_flow(mesh, kind):
    if kind == "text":
        raw = field(3, b"The quick brown fox jumps over the lazy dog. " * (100 * MB // 45 + 1))
    else:  # TokenIds, packed: 100M ids of 1 byte each
        raw = field(4, field(1, b"\x05" * (100 * MB)))
    assert len(raw) >= 100 * MB
    with Flow(mesh["router"]) as flow, Rss(mesh["router_pid"]) as rss:
        time.sleep(0.3)
        err, took = send_raw(mesh["router"], raw)
        time.sleep(0.3)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err.details()
    assert took < 5, took  # refused from the length prefix: fractions of a second (89 s before)
    assert rss.growth_mb < 200, rss.growth_mb
    assert not flow.errors and flow.streams >= 1
    assert max(flow.gaps) < 2.0, max(flow.gaps)  # seconds-long stalls before


def test_text_over_the_bound_is_out_of_range_before_tokenizing_while_streams_flow(mesh, tiny_model_dir):
    limits = RequestLimits.for_model(256, Tokenizer.from_model_dir(tiny_model_dir))
    text = "x" * (limits.text_bytes + 1)  # within the message size, beyond any text that fits the context
    assert len(text) < limits.message_bytes
    with Flow(mesh["router"]) as flow:
        with grpc.insecure_channel(mesh["router"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                list(gen_grpc.GenerationStub(ch).Generate(build_request(prompt=text), timeout=30))
    assert e.value.code() == grpc.StatusCode.OUT_OF_RANGE
    assert e.value.details().startswith("prompt: ")
    assert not flow.errors


def test_a_request_within_the_bound_is_still_served(mesh):
    with grpc.insecure_channel(mesh["router"]) as ch:
        out = list(gen_grpc.GenerationStub(ch).Generate(build_request(prompt="Hello " * 40, max_new_tokens=3), timeout=60))
    assert out[-1].finish_reason in ("length", "stop")
