"""The frames of the torch.distributed data plane: one request and one reply per expert call.

Shape legend: G experts named, C counts (G, or 0 with weights), R rows, H hidden.

A frame is `HEADER_WORDS` int64 words (the last one the payload's byte count) and a payload of
byte-packed tensors. gRPC only opens the link (`OpenDistLink`); every call after that is frames on
the pair group, so a call costs one message each way and no gRPC round trip.

    request  words [FORWARD, layer, placement_version, G, C, R, H, dtype, has_weights, ..., nbytes]
             payload expert_ids int64[G] | counts int64[C] | weights float32[R, G] | x[R, H]
    request  words [CLOSE, ...]: the client is done with the link; the server answers CLOSED and ends it
    reply    words [OK, R, H, dtype, ..., nbytes]   payload y[R, H]
    reply    words [grpc status code, ..., nbytes]  payload the error message, UTF-8
    reply    words [CLOSED, ...]

Every part starts at a multiple of its element size (int64 parts first, then float32 weights), so
the receiver views the payload in place. Malformed frames raise `FrameError` naming the field.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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


def nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


@dataclass(frozen=True)
class ForwardCall:
    """One expert call as it travels: x [R, H] grouped rows with counts [G], or tokens with weights [R, G]."""

    layer: int
    placement_version: int
    expert_ids: list[int]  # [G]
    counts: list[int]  # [G], empty when weights is set
    x: Tensor  # [R, H]
    weights: Tensor | None = None  # [R, G] float32


def request_frame(call: ForwardCall) -> tuple[list[int], list[Tensor]]:
    """(words without the byte count, payload parts) of `call`'s request."""
    ids = torch.tensor(call.expert_ids, dtype=torch.int64)  # [G]
    counts = torch.tensor(call.counts, dtype=torch.int64)  # [C]
    rows, hidden = call.x.shape
    words = [FORWARD, call.layer, call.placement_version, len(call.expert_ids), len(call.counts), rows, hidden,
             dtype_code(call.x.dtype), int(call.weights is not None)]
    parts = [ids, counts] + ([call.weights.float()] if call.weights is not None else []) + [call.x]
    return words, parts


def parse_request(words: list[int], payload: Tensor) -> ForwardCall:
    """The call in a FORWARD request frame; payload uint8 [nbytes] (x views it, no copy)."""
    _, layer, version, g, c, rows, hidden, code, has_weights = words[:9]
    for name, v in (("layer", layer), ("placement_version", version), ("expert_ids count", g), ("counts count", c), ("rows", rows), ("hidden", hidden)):
        if v < 0:
            raise FrameError(f"dist frame: {name} is {v}, must be >= 0")
    if has_weights not in (0, 1):
        raise FrameError(f"dist frame: has_weights is {has_weights}, must be 0 or 1")
    dtype = code_dtype(code, "dist frame: x dtype")
    sizes = [8 * g, 8 * c, 4 * rows * g * has_weights, rows * hidden * dtype.itemsize]
    if sum(sizes) != payload.numel():
        raise FrameError(
            f"dist frame: payload has {payload.numel()} bytes, expert_ids [{g}], counts [{c}], "
            f"weights [{rows}, {g}] x {has_weights} and x [{rows}, {hidden}] {dtype} need {sum(sizes)}"
        )
    ids, counts, weights, x = _split(payload, sizes)
    return ForwardCall(
        layer=layer,
        placement_version=version,
        expert_ids=viewed(ids, torch.int64).tolist(),
        counts=viewed(counts, torch.int64).tolist(),
        x=viewed(x, dtype).view(rows, hidden),
        weights=viewed(weights, torch.float32).view(rows, g) if has_weights else None,
    )


def ok_reply(y: Tensor) -> tuple[list[int], list[Tensor]]:
    """y [R, H] as a reply frame."""
    return [OK, y.shape[0], y.shape[1], dtype_code(y.dtype)], [y]


def error_reply(code: int, message: str) -> tuple[list[int], list[Tensor]]:
    """A failed call: its gRPC status code (1..16) and message."""
    text = message.encode()
    return [code], ([torch.frombuffer(bytearray(text), dtype=torch.uint8)] if text else [])


def parse_reply(words: list[int], payload: Tensor) -> Tensor | tuple[int, str]:
    """y [R, H] (viewing payload) of an OK reply, or (status code, message) of a failed one."""
    status = words[0]
    if status != OK:
        return status, bytes(payload.cpu().numpy()).decode(errors="replace")
    rows, hidden, code = words[1:4]
    dtype = code_dtype(code, "dist reply: y dtype")
    if rows < 0 or hidden < 0 or rows * hidden * dtype.itemsize != payload.numel():
        raise FrameError(f"dist reply: payload has {payload.numel()} bytes, y [{rows}, {hidden}] {dtype} needs {max(rows * hidden, 0) * dtype.itemsize}")
    return viewed(payload, dtype).view(rows, hidden)


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
