"""The frames of the torch.distributed data plane: one request and one reply per expert call.

Shape legend: G experts named, N rows, T tokens, H hidden.

A frame is `HEADER_WORDS` int64 words (the last one the payload's byte count) and a payload of
byte-packed tensors. gRPC only opens the link (`OpenDistLink`); every call after that is frames on
the pair group, so a call costs one message each way and no gRPC round trip.

    request  words [FORWARD, layer, placement_version, G, N, T, H, dtype, ..., nbytes]
             payload expert_ids int64[G] | counts int64[G] | token_idx int32[N] | weights float32[N] | x[T, H]
    request  words [CLOSE, ...]: the client is done with the link; the server answers CLOSED and ends it
    reply    words [OK, T, H, dtype, ..., nbytes]   payload y[T, H]
    reply    words [grpc status code, ..., nbytes]  payload the error message, UTF-8
    reply    words [CLOSED, ...]

The int64 parts come first, then the 4-byte ones, so the receiver views the payload in place (x is
copied only when its element size exceeds the alignment left, e.g. float64 after an odd N).
Frames whose words and payload disagree raise `FrameError` naming the field; what the values mean
(held experts, token indices in range) the server checks like any other request.
"""
from __future__ import annotations

import torch
from torch import Tensor

from moemesh.transport.base import ExpertRequest

HEADER_WORDS = 16
HEADER_BYTES = HEADER_WORDS * 8

FORWARD, CLOSE = 1, 2  # request kinds
OK, CLOSED = 0, -1  # reply statuses besides gRPC codes (1..16)

# wire codes of x's dtype (index + 1)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


class FrameError(ValueError):
    """A frame whose words and payload disagree, or that names an unknown kind or dtype."""


def dtype_code(dtype: torch.dtype) -> int:
    if dtype not in DTYPES:
        raise FrameError(f"dtype {dtype} cannot travel over the dist transport (one of {[str(d) for d in DTYPES]})")
    return DTYPES.index(dtype) + 1


def code_dtype(code: int, field: str) -> torch.dtype:
    if not 1 <= code <= len(DTYPES):
        raise FrameError(f"{field} code {code} is not one of 1..{len(DTYPES)} ({[str(d) for d in DTYPES]})")
    return DTYPES[code - 1]


def as_bytes(t: Tensor) -> Tensor:
    """t's elements as a flat uint8 view (contiguous copy when needed)."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def request_frame(req: ExpertRequest) -> tuple[list[int], list[Tensor]]:
    """(words without the byte count, payload parts) of `req`'s request."""
    tokens, hidden = req.x.shape
    words = [FORWARD, req.layer, req.placement_version, req.expert_ids.numel(), req.token_idx.numel(), tokens, hidden,
             dtype_code(req.x.dtype)]
    ints = [req.expert_ids.to(torch.int64), req.counts.to(torch.int64), req.token_idx.to(torch.int32)]
    return words, ints + [req.weights.to(torch.float32), req.x]


def parse_request(words: list[int], payload: Tensor) -> ExpertRequest:
    """The request in a FORWARD frame; payload uint8 [nbytes] (the parts view it, no copy)."""
    _, layer, version, g, n, tokens, hidden, code = words[:8]
    for name, v in (("layer", layer), ("placement_version", version), ("expert_ids count", g), ("rows", n), ("tokens", tokens), ("hidden", hidden)):
        if v < 0:
            raise FrameError(f"dist frame: {name} is {v}, must be >= 0")
    dtype = code_dtype(code, "dist frame: x dtype")
    sizes = [8 * g, 8 * g, 4 * n, 4 * n, tokens * hidden * dtype.itemsize]
    if sum(sizes) != payload.numel():
        raise FrameError(
            f"dist frame: payload has {payload.numel()} bytes, expert_ids and counts [{g}], token_idx and weights [{n}] "
            f"and x [{tokens}, {hidden}] {dtype} need {sum(sizes)}"
        )
    ids, counts, token_idx, weights, x = _split(payload, sizes)
    return ExpertRequest(
        layer=layer,
        placement_version=version,
        x=viewed(x, dtype).view(tokens, hidden),
        token_idx=viewed(token_idx, torch.int32),
        weights=viewed(weights, torch.float32),
        expert_ids=viewed(ids, torch.int64),
        counts=viewed(counts, torch.int64),
    )


def ok_reply(y: Tensor) -> tuple[list[int], list[Tensor]]:
    """y [T, H] as a reply frame."""
    return [OK, y.shape[0], y.shape[1], dtype_code(y.dtype)], [y]


def error_reply(code: int, message: str) -> tuple[list[int], list[Tensor]]:
    """A failed call: its gRPC status code (1..16) and message."""
    text = message.encode()
    return [code], ([torch.frombuffer(bytearray(text), dtype=torch.uint8)] if text else [])


def parse_reply(words: list[int], payload: Tensor) -> Tensor | tuple[int, str]:
    """y [T, H] (viewing payload) of an OK reply, or (status code, message) of a failed one."""
    status = words[0]
    if status != OK:
        return status, bytes(payload.cpu().numpy()).decode(errors="replace")
    tokens, hidden, code = words[1:4]
    dtype = code_dtype(code, "dist reply: y dtype")
    if tokens < 0 or hidden < 0 or tokens * hidden * dtype.itemsize != payload.numel():
        raise FrameError(f"dist reply: payload has {payload.numel()} bytes, y [{tokens}, {hidden}] {dtype} needs {max(tokens * hidden, 0) * dtype.itemsize}")
    return viewed(payload, dtype).view(tokens, hidden)


def viewed(part: Tensor, dtype: torch.dtype) -> Tensor:
    """uint8 bytes as `dtype` elements: a view, or a copy when the bytes sit misaligned for it."""
    if part.storage_offset() % dtype.itemsize:
        part = part.clone()
    return part.view(dtype)


def _split(payload: Tensor, sizes: list[int]) -> list[Tensor]:
    out, start = [], 0
    for n in sizes:
        out.append(payload[start:start + n])
        start += n
    return out
