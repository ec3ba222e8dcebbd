"""Frames of the dist data plane, packed and parsed without a link."""
from __future__ import annotations

import pytest
import torch

from moemesh.transport.dist_frames import (
    CLOSED, FORWARD, HEADER_WORDS, OK, ForwardCall, FrameError, as_bytes, error_reply, ok_reply, parse_reply, parse_request,
    request_frame,
)


def packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The payload as the link sends it: the parts' bytes back to back."""
    flat = [as_bytes(p) for p in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def round_trip(call: ForwardCall) -> ForwardCall:
    words, parts = request_frame(call)
    assert len(words) < HEADER_WORDS
    return parse_request(words + [0] * (HEADER_WORDS - 1 - len(words)) + [0], packed(parts))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_grouped_call_round_trips_bit_exactly(dtype):
    x = torch.randn(7, 12).to(dtype)
    got = round_trip(ForwardCall(layer=3, placement_version=9, expert_ids=[5, 1], counts=[3, 4], x=x))
    assert (got.layer, got.placement_version, got.expert_ids, got.counts, got.weights) == (3, 9, [5, 1], [3, 4], None)
    assert got.x.dtype == dtype and torch.equal(got.x.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_weighted_call_round_trips(dtype):
    # 3 x 3 float32 weights leave x at an offset that is no multiple of 8: float64 is copied, not viewed
    x, w = torch.randn(3, 4).to(dtype), torch.rand(3, 3)
    got = round_trip(ForwardCall(layer=0, placement_version=1, expert_ids=[0, 2, 7], counts=[], x=x, weights=w))
    assert got.counts == [] and torch.equal(got.weights, w) and torch.equal(got.x, x)


def test_empty_call_round_trips():
    got = round_trip(ForwardCall(layer=1, placement_version=0, expert_ids=[4], counts=[0], x=torch.empty(0, 8)))
    assert got.x.shape == (0, 8) and got.counts == [0]


def header(*words: int) -> list[int]:
    return list(words) + [0] * (HEADER_WORDS - len(words))


@pytest.mark.parametrize("words, nbytes, match", [
    (header(FORWARD, 0, 0, 1, 1, 2, 4, 1, 0), 8 + 8 + 31, "payload has 47 bytes.*need 48"),
    (header(FORWARD, 0, 0, 1, 1, -2, 4, 1, 0), 16, "rows is -2"),
    (header(FORWARD, -1, 0, 1, 1, 0, 4, 1, 0), 16, "layer is -1"),
    (header(FORWARD, 0, 0, 1, 1, 0, 4, 9, 0), 16, "x dtype code 9"),
    (header(FORWARD, 0, 0, 1, 0, 0, 4, 1, 2), 8, "has_weights is 2"),
])
def test_malformed_requests_name_the_field(words, nbytes, match):
    with pytest.raises(FrameError, match=match):
        parse_request(words, torch.zeros(nbytes, dtype=torch.uint8))


def test_unsupported_dtype_is_refused_when_packing():
    with pytest.raises(FrameError, match="cannot travel"):
        request_frame(ForwardCall(0, 0, [0], [2], torch.zeros(2, 4, dtype=torch.int32)))


def test_replies_round_trip():
    y = torch.randn(5, 6).to(torch.bfloat16)
    words, parts = ok_reply(y)
    assert words[0] == OK
    assert torch.equal(parse_reply(header(*words), packed(parts)), y)
    words, parts = error_reply(9, "layer 3: experts [4] are not held")
    assert parse_reply(header(*words), packed(parts)) == (9, "layer 3: experts [4] are not held")
    assert parse_reply(header(*error_reply(13, "")[0]), packed([])) == (13, "")
    with pytest.raises(FrameError, match=r"y \[5, 6\] torch.bfloat16 needs 60"):
        parse_reply(header(OK, 5, 6, 2), torch.zeros(7, dtype=torch.uint8))
    assert CLOSED != OK
