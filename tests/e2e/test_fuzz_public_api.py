"""A property-based fuzz test of the public Generation API against a live mesh on the demo model
(control plane, an expert server, an attention replica and the router, as `moemesh up` starts them).

Hypothesis draws every GenerateRequest field, extremes included: empty, huge, negative, NaN and
infinite numbers, invalid UTF-8 (written into the raw bytes), unknown model names, ids of a request
that is still running, streams cancelled mid-way. Whatever it sends: no UNKNOWN or INTERNAL status,
every error names the field it is about, and afterwards the mesh serves a normal request with the
same greedy tokens as before the fuzzing. Bounded: 100 examples, at most 8 messages read per stream.
"""
from __future__ import annotations

import math
import re

import grpc
import pytest
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from moemesh.launcher.mesh import Mesh, MeshSpec
from moemesh.rpc.generation import build_request
from tests.fixtures.services import gen_grpc, gen_pb

pytestmark = pytest.mark.slow

FIELDS = ("request_id", "model", "prompt", "prompt_token_ids", "messages", "max_new_tokens", "temperature", "top_p",
          "top_k", "seed", "stop", "stop_token_ids", "logprobs", "prompt_logprobs", "ignore_eos", "request")
NAMES_A_FIELD = re.compile(rf"^({'|'.join(FIELDS)})(\[\d+\])?(\.[a-z_]+)?(:| )")
STRING_FIELDS = {"request_id": 1, "model": 2, "prompt": 3, "stop": 11}
MAX_MESSAGES_READ = 8
BASELINE = dict(messages=[("user", "What is the capital of France?")], max_new_tokens=8, temperature=0.0)


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """(stub, raw Generate callable taking serialized bytes, greedy tokens of BASELINE before fuzzing)."""
    from moemesh.demo_model import ensure_demo_model

    model = ensure_demo_model()
    m = Mesh(MeshSpec(model_dir=str(model), expert_servers=1), tmp_path_factory.mktemp("fuzz-logs"))
    router, _ = m.start()
    try:
        with grpc.insecure_channel(router) as ch:
            stub = gen_grpc.GenerationStub(ch)
            raw = ch.unary_stream("/moemesh.v1.Generation/Generate", request_serializer=None,
                                  response_deserializer=gen_pb.GenerateResponse.FromString)
            yield stub, raw, tokens_of(stub, build_request(**BASELINE))
    finally:
        m.stop()


def tokens_of(stub, req) -> list[int]:
    return [t for r in stub.Generate(req, timeout=300) for t in r.token_ids]


def mostly(valid, extreme):
    """`valid` 14 times in 15, else `extreme`: with a dozen fields about half the requests are valid
    and served, and every field still meets its extremes."""
    return st.sampled_from([True] * 14 + [False]).flatmap(lambda ok: valid if ok else extreme)


ints = st.one_of(
    st.sampled_from([-(2**63), -(2**31), -1, 0, 1, 2, 7, 63, 64, 255, 256, 8191, 8192, 49151, 49152, 2**31, 2**63 - 1]),
    st.integers(-(2**63), 2**63 - 1),
)
floats = st.one_of(
    st.sampled_from([0.0, -0.0, 5e-324, 1e-300, 1e-45, 1e-7, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 1e300, -1.0,
                     math.inf, -math.inf, math.nan]),
    st.floats(allow_nan=True, allow_infinity=True),
)
texts = st.one_of(
    st.text(max_size=30),
    st.sampled_from(["", " ", "\x00", "<|im_start|>", "<|im_end|>", "\u00e9" * 40, "\U0001f600" * 10, "x" * 300]),
)
token_ids = st.integers(0, 49151)
short_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=40)
valid_input = st.one_of(
    st.builds(lambda p: {"prompt": p}, short_text),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(token_ids, min_size=1, max_size=16)),
    st.builds(lambda ms: {"messages": ms}, st.lists(st.tuples(st.sampled_from(["system", "user", "assistant"]), short_text),
                                                   min_size=1, max_size=3)),
)
extreme_input = st.one_of(
    st.just({}),
    st.builds(lambda p: {"prompt": p}, texts),
    st.builds(lambda ids: {"prompt_token_ids": ids}, st.lists(st.one_of(ints, token_ids), max_size=12)),
    st.builds(lambda n: {"prompt_token_ids": [5] * n}, st.sampled_from([8192, 9000])),  # at or over the context
    st.builds(lambda n: {"prompt": "word " * n}, st.sampled_from([9000, 40000])),
    st.builds(lambda ms: {"messages": ms}, st.lists(st.tuples(texts, texts), max_size=4)),
)
SAMPLING = {
    "max_new_tokens": (st.integers(1, 8), ints),
    "temperature": (st.one_of(st.floats(0, 2), st.sampled_from([5e-324, 1e-300, 1e-7])), floats),
    "top_p": (st.one_of(st.floats(1e-3, 1), st.sampled_from([5e-324, 1e-300, 1e-45])), floats),
    "top_k": (st.integers(0, 100), ints),
    "seed": (ints, ints),
}


@st.composite
def requests(draw):
    """(GenerateRequest kwargs, stop token ids, string field to corrupt with invalid UTF-8 or None,
    cancel after n messages, whether a stream with the same id runs meanwhile)."""
    kw = dict(draw(mostly(valid_input, extreme_input)))
    kw["request_id"] = draw(mostly(st.one_of(st.just(""), st.text("abcdef0123456789-", max_size=32)),
                                   st.one_of(texts, st.text(min_size=257, max_size=260))))
    kw["model"] = draw(mostly(st.sampled_from(["", "demo-smollm2-moe"]), st.one_of(texts, st.just("m" * 1000))))
    for name, (valid, extreme) in SAMPLING.items():
        if draw(st.booleans()):
            kw[name] = draw(mostly(valid, extreme))
    kw["stop"] = draw(mostly(st.lists(short_text, max_size=4),
                             st.one_of(st.lists(texts, max_size=4), st.lists(st.just("a"), min_size=65, max_size=66))))
    stop_ids = draw(mostly(st.lists(token_ids, max_size=4),
                           st.one_of(st.lists(ints, max_size=4), st.lists(st.just(2), min_size=257, max_size=258))))
    for name in ("logprobs", "prompt_logprobs", "ignore_eos"):
        kw[name] = draw(st.booleans())
    corrupt = draw(mostly(st.none(), st.sampled_from(sorted(STRING_FIELDS))))
    cancel_after = draw(st.integers(1, MAX_MESSAGES_READ))
    duplicate = draw(mostly(st.just(False), st.just(True)))
    if duplicate:
        kw["request_id"] = "fuzz-dup"
    return kw, stop_ids, corrupt, cancel_after, duplicate


def serialize(kw: dict, stop_ids: list[int], corrupt: str | None) -> bytes:
    req = build_request(**kw)
    req.stop_token_ids.extend(stop_ids)
    raw = req.SerializeToString()
    if corrupt is not None:  # one more entry of that string field, not valid UTF-8
        raw += bytes([STRING_FIELDS[corrupt] << 3 | 2, 4]) + b"ok\xff\xfe"
    return raw


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=requests())
def test_any_request_gets_a_stream_or_an_error_naming_a_field(mesh, case):
    stub, raw_generate, _ = mesh
    kw, stop_ids, corrupt, cancel_after, duplicate = case
    try:
        raw = serialize(kw, stop_ids, corrupt)
    except ValueError:  # protobuf refuses to serialize it (e.g. a lone surrogate): nothing to send
        assume(False)
    first = None
    if duplicate:  # a stream with the same id is running while this request arrives
        first = stub.Generate(build_request(request_id="fuzz-dup", prompt_token_ids=[5, 6], max_new_tokens=64, ignore_eos=True),
                              timeout=120)
        next(first)
    try:
        outcome = send(raw_generate, raw, cancel_after)
    finally:
        if first is not None:
            first.cancel()
    event(f"{outcome.code().name} ({(outcome.details() or '')[:60]})" if isinstance(outcome, grpc.RpcError)
          else f"served: {outcome}")
    if isinstance(outcome, grpc.RpcError):
        code, details = outcome.code(), outcome.details() or ""
        assert code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (code, details, kw)
        assert NAMES_A_FIELD.match(details), (code, details, kw)
        if "not valid UTF-8" in details:  # (another bad field may be reported first)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(corrupt), (details, corrupt)
        if code == grpc.StatusCode.ALREADY_EXISTS:
            assert duplicate and details.startswith("request_id"), (details, kw)
    else:
        assert corrupt is None, f"invalid UTF-8 in {corrupt} was accepted"
        assert outcome in ("stop", "length", "abort", "cancelled"), outcome


def send(raw_generate, raw: bytes, cancel_after: int):
    """Sends the serialized request; reads up to `cancel_after` messages, then cancels. Returns the
    finish reason, "cancelled", or the RpcError."""
    call = raw_generate(raw, timeout=120)
    try:
        for n, resp in enumerate(call, start=1):
            if resp.finish_reason:
                return resp.finish_reason
            if n >= cancel_after:
                call.cancel()
                return "cancelled"
        return "ended without a finish reason"
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.CANCELLED and call.cancelled():
            return "cancelled"
        return e


def test_the_mesh_still_serves_the_same_greedy_tokens_after_the_fuzzing(mesh):
    stub, _, baseline = mesh
    assert baseline and tokens_of(stub, build_request(**BASELINE)) == baseline
