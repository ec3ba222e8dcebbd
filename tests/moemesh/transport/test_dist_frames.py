"""Frames of the dist data plane, packed and parsed without a link."""
from __future__ import annotations

import pytest
import torch

from moemesh.transport.base import ExpertRequest
from moemesh.transport.dist_frames import (
    CLOSED, FORWARD, HEADER_WORDS, OK, FrameError, as_bytes, error_reply, ok_reply, parse_reply, parse_request, request_frame,
)


def packed(parts: list[torch.Tensor]) -> torch.Tensor:
    """The payload as the link sends it: the parts' bytes back to back."""
    flat = [as_bytes(p) for p in parts]
    return torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8)


def round_trip(req: ExpertRequest) -> ExpertRequest:
    words, parts = request_frame(req)
    assert len(words) < HEADER_WORDS
    return parse_request(words + [0] * (HEADER_WORDS - 1 - len(words)) + [0], packed(parts))


def request(x: torch.Tensor, rows: int, layer: int = 3, version: int = 9) -> ExpertRequest:
    t = x.shape[0]
    return ExpertRequest(layer, version, x, torch.arange(rows, dtype=torch.int32) % max(t, 1), torch.rand(rows),
                         torch.tensor([5, 1]), torch.tensor([rows - rows // 2, rows // 2]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("rows", [7, 8])
def test_request_round_trips_bit_exactly(dtype, rows):
    # an odd number of rows leaves x at an offset that is no multiple of 8: float64 is copied, not viewed
    x = torch.randn(5, 12).to(dtype)
    req = request(x, rows)
    got = round_trip(req)
    assert (got.layer, got.placement_version) == (3, 9)
    for name in ("token_idx", "weights", "expert_ids", "counts"):
        assert getattr(got, name).dtype == getattr(req, name).dtype and torch.equal(getattr(got, name), getattr(req, name)), name
    assert got.x.dtype == dtype and torch.equal(got.x.view(torch.uint8), x.view(torch.uint8))


def test_empty_request_round_trips():
    got = round_trip(request(torch.empty(0, 8), 0, layer=1, version=0))
    assert got.x.shape == (0, 8) and got.token_idx.numel() == 0 and got.counts.tolist() == [0, 0]


def header(*words: int) -> list[int]:
    return list(words) + [0] * (HEADER_WORDS - len(words))


@pytest.mark.parametrize("words, nbytes, match", [
    (header(FORWARD, 0, 0, 1, 1, 2, 4, 1), 8 + 8 + 4 + 4 + 31, "payload has 55 bytes.*need 56"),
    (header(FORWARD, 0, 0, 1, -2, 2, 4, 1), 16, "rows is -2"),
    (header(FORWARD, 0, 0, 1, 1, -1, 4, 1), 16, "tokens is -1"),
    (header(FORWARD, -1, 0, 1, 1, 0, 4, 1), 16, "layer is -1"),
    (header(FORWARD, 0, 0, 1, 1, 0, 4, 9), 24, "x dtype code 9"),
])
def test_malformed_requests_name_the_field(words, nbytes, match):
    with pytest.raises(FrameError, match=match):
        parse_request(words, torch.zeros(nbytes, dtype=torch.uint8))


def test_unsupported_dtype_is_refused_when_packing():
    with pytest.raises(FrameError, match="cannot travel"):
        request_frame(request(torch.zeros(2, 4, dtype=torch.int32), 2))


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
