"""Size limits before any work: text measured before it is tokenized, ids counted before they are
validated, repeated entries counted on the wire before parsing, tokenizing off the event loop."""
from __future__ import annotations

import asyncio
import time
from dataclasses import replace

import pytest

from moemesh.errors import MeshError
from moemesh.rpc.generation import build_request
from router_svc.limits import NORMALIZATION_SLACK, RequestLimits
from router_svc.prepare import MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS, MAX_TOOLS, RequestPreparer
from router_svc.router import Router
from router_svc.admission import Admission
from router_svc.replicas import Replica, ReplicaSet
from router_svc.types import ChatTurn, GenerationInput
from router_svc.wire_shape import WireLimits, check_wire_shape
from tests.router_svc.fakes import FakeAttention


def varint(x: int) -> bytes:
    out = bytearray()
    while True:
        b, x = x & 0x7F, x >> 7
        out.append(b | (0x80 if x else 0))
        if not x:
            return bytes(out)


class CountingTokenizer:
    """Wraps a tokenizer and counts the bytes it was asked to encode."""

    def __init__(self, inner):
        self.inner = inner
        self.encoded = 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def encode(self, text, add_special_tokens=True):
        self.encoded += len(text)
        return self.inner.encode(text, add_special_tokens)


def test_the_text_bound_covers_the_longest_token_over_the_whole_context(info, tokenizer):
    limits = RequestLimits.for_model(info.max_context, tokenizer)
    slack = NORMALIZATION_SLACK if tokenizer.normalizes else 1
    assert limits.text_bytes == info.max_context * tokenizer.max_token_bytes * slack
    # the worst case a fitting prompt can be: the longest entry, max_context - 1 times
    longest = max(tokenizer._backend.get_vocab(with_added_tokens=True), key=lambda t: len(t.encode()))
    text = tokenizer.decode([tokenizer.token_to_id(longest)] * (info.max_context - 1), skip_special_tokens=False)
    assert len(text.encode()) <= limits.text_bytes
    assert limits.message_bytes >= 2 * limits.text_bytes


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_text_over_the_bound_is_out_of_range_without_tokenizing(info, tokenizer, field):
    tok = CountingTokenizer(tokenizer)
    prep = RequestPreparer(info, tok)
    text = "a" * (prep.limits.text_bytes + 1)
    req = GenerationInput(prompt=text) if field == "prompt" else GenerationInput(messages=(ChatTurn("user", text),))
    with pytest.raises(MeshError) as e:
        prep.prepare(req)
    assert e.value.code.name == "OUT_OF_RANGE" and e.value.message.startswith(f"{field}: ")
    assert tok.encoded == 0


def test_too_many_ids_are_out_of_range_before_they_are_checked(info):
    class Ids:  # a sequence that fails if anything walks it
        def __len__(self):
            return 10**7

        def __iter__(self):
            raise AssertionError("the ids were walked")

        __getitem__ = __iter__

    with pytest.raises(MeshError) as e:
        RequestPreparer(info).prepare(GenerationInput(prompt_token_ids=Ids()))
    assert e.value.code.name == "OUT_OF_RANGE" and e.value.message.startswith("prompt_token_ids: 10000000 tokens")


def test_stop_strings_together_are_bounded(info, tokenizer):
    prep = RequestPreparer(info, tokenizer)
    big = "x" * (prep.limits.text_bytes // 2 + 1)
    with pytest.raises(MeshError) as e:
        prep.prepare(GenerationInput(prompt_token_ids=(5,), stop=(big, big)))
    assert e.value.code.name == "OUT_OF_RANGE" and e.value.message.startswith("stop: ")


WIRE = WireLimits(64, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS, MAX_TEMPLATE_KWARGS, MAX_TOOL_CALLS)


def message(*fields: bytes) -> bytes:
    """A ChatMessage entry of ChatMessages (field 1) holding `fields`."""
    body = b"".join(fields)
    return b"\x0a" + varint(len(body)) + body


@pytest.mark.parametrize("raw, field", [
    (b"\x5a\x01a" * (MAX_STOP_STRINGS + 1), "stop"),
    (b"\x60\x05" * (MAX_STOP_TOKEN_IDS + 1), "stop_token_ids"),  # unpacked
    (b"\x62" + varint(10 * MAX_STOP_TOKEN_IDS + 1) + b"\x05" * (10 * MAX_STOP_TOKEN_IDS + 1), "stop_token_ids"),  # packed
    (b"\x82\x01\x00" * (MAX_TOOLS + 1), "tools"),
    (b"\x8a\x01\x00" * (MAX_TEMPLATE_KWARGS + 1), "chat_template_kwargs"),
    (b"\x2a" + varint(2 * 65) + b"\x0a\x00" * 65, "messages"),
    (b"\x2a" + varint(3 + 2 * (MAX_TOOL_CALLS + 1)) + message(b"\x1a\x00" * (MAX_TOOL_CALLS + 1)), "messages[0].tool_calls"),
    (b"\x2a" + varint(64 * 43) + message(b"\x2a\x00" * 20) * 64, "messages"),  # fields beyond the budget
    (b"\xf8\x07\x01" * 100, "request"),  # an unknown field, many times
])
def test_too_many_repeated_entries_are_refused_on_the_wire(raw, field):
    with pytest.raises(MeshError) as e:
        check_wire_shape(raw, WIRE)
    assert e.value.message.startswith(f"{field}: ")


def test_a_valid_request_passes_the_wire_check():
    req = build_request(messages=[("user", "hi")] * 64, stop=["a"] * MAX_STOP_STRINGS, max_new_tokens=3, temperature=0.5)
    req.stop_token_ids.extend(range(MAX_STOP_TOKEN_IDS))
    for i in range(MAX_TOOLS):
        req.tools.add(name=f"tool{i}")
    for i in range(MAX_TEMPLATE_KWARGS):
        req.chat_template_kwargs[f"k{i}"] = "true"
    for _ in range(MAX_TOOL_CALLS):
        req.messages.messages[0].tool_calls.add(name="f", arguments="{}")
    check_wire_shape(req.SerializeToString(), WIRE)
    check_wire_shape(b"\x1a\x05ab", WIRE)  # malformed: left to the parser


def test_a_long_prompt_is_tokenized_off_the_event_loop(info, tokenizer):
    """2 MB of text (within the bound of a 2M-token context) takes a while to tokenize: other
    coroutines keep running meanwhile (on the event loop it stalled them for all of it)."""
    big = replace(info, max_context=2_000_000, max_new_tokens_limit=999_999)
    router = Router(big, ReplicaSet([Replica("fake", FakeAttention([7, 8]))]), Admission(4, 4), tokenizer)
    text = "The quick brown fox jumps over the lazy dog. " * (2_000_000 // 45)

    async def main():
        gaps = []

        async def tick():
            last = time.perf_counter()
            while True:
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        ticker = asyncio.create_task(tick())
        started = time.perf_counter()
        items = [i async for i in router.generate(GenerationInput(prompt=text, sampling=replace(GenerationInput().sampling, max_new_tokens=2)))]
        took = time.perf_counter() - started
        ticker.cancel()
        return items, gaps, took

    items, gaps, took = asyncio.run(main())
    assert items[-1].finish_reason == "length" and len(items[-1].prompt_token_ids) > 100_000
    assert max(gaps) < max(took / 2, 0.1), (max(gaps), took)
