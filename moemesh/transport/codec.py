"""Tensor <-> `moemesh.v1.Tensor` without pickle: raw row-major bytes plus dtype name and shape.

Encoding views the (contiguous, CPU) tensor's storage as bytes, so bfloat16, float8 and packed
float4 (`float4_e2m1fn_x2`, two values per byte) travel bit-exactly like any other dtype. Decoding
wraps the message's bytes without copying (`torch.frombuffer`); the result is read-only memory:
clone it before writing in place. Every decode checks the dtype against the allow-list and the shape
against the byte count, and raises `CodecError` naming the field (the message size is bounded by the
channel's limit, `RpcConfig.max_message_mb`).
"""
from __future__ import annotations

import math
import warnings
from typing import Any

import torch

from moemesh.rpc.protos import load

tensor_pb2, _ = load("tensor")

ALLOWED_DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, name)
    for name in (
        "float32", "float64", "float16", "bfloat16",
        "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
        "float4_e2m1fn_x2",
        "int8", "uint8", "int16", "int32", "int64", "bool",
    )
    if hasattr(torch, name)
}
DTYPE_NAMES = {dtype: name for name, dtype in ALLOWED_DTYPES.items()}
MAX_DIMS = 8


class CodecError(ValueError):
    """A tensor message that cannot be decoded (or a tensor that cannot be encoded)."""


def dtype_name(dtype: torch.dtype) -> str:
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise CodecError(f"dtype {dtype} is not in the wire allow-list {sorted(ALLOWED_DTYPES)}")
    return name


def parse_dtype(name: str, field: str = "tensor") -> torch.dtype:
    dtype = ALLOWED_DTYPES.get(name)
    if dtype is None:
        raise CodecError(f"{field}.dtype {name!r} is not one of {sorted(ALLOWED_DTYPES)}")
    return dtype


def tensor_bytes(t: torch.Tensor) -> bytes:
    """The raw row-major bytes of `t` (moved to CPU and made contiguous when needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return t.view(torch.uint8).numpy().tobytes()


def encode(t: torch.Tensor, out: Any = None) -> Any:
    """A `moemesh.v1.Tensor` holding `t`; fills `out` (e.g. `request.x`) in place when given."""
    msg = tensor_pb2.Tensor() if out is None else out
    msg.dtype = dtype_name(t.dtype)
    del msg.shape[:]
    msg.shape.extend(int(s) for s in t.shape)
    msg.data = tensor_bytes(t)
    return msg


def check_shape(shape, field: str) -> tuple[int, ...]:
    """`shape` (a sequence of ints, e.g. the message's repeated field) as a tuple, checked."""
    shape = tuple(shape)
    if len(shape) > MAX_DIMS:
        raise CodecError(f"{field}.shape has {len(shape)} dimensions, at most {MAX_DIMS} are allowed")
    if any(s < 0 for s in shape):
        i = next(i for i, s in enumerate(shape) if s < 0)
        raise CodecError(f"{field}.shape[{i}] is {shape[i]}, must be >= 0")
    return shape


def _spend_buffer_warning() -> None:
    """torch warns once per process that a tensor over a read-only buffer must not be written
    (`TORCH_WARN_ONCE`): spent here, silenced, when the module loads, so `decode` needs no warnings
    context per call (documented above: decoded tensors are read-only)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        torch.frombuffer(b"\0", dtype=torch.uint8)


_spend_buffer_warning()


def decode(msg: Any, field: str = "tensor", ndim: int | None = None) -> torch.Tensor:
    """A CPU tensor viewing `msg.data` (read-only, no copy). `field` names the message in errors."""
    dtype = parse_dtype(msg.dtype, field)
    shape = check_shape(msg.shape, field)
    if ndim is not None and len(shape) != ndim:
        raise CodecError(f"{field}.shape {list(shape)} must have {ndim} dimensions")
    data = msg.data  # read once: each read of a bytes field makes a new bytes object
    count = math.prod(shape)
    expected = count * dtype.itemsize
    if len(data) != expected:
        raise CodecError(f"{field}.data has {len(data)} bytes, shape {list(shape)} of {msg.dtype} needs {expected}")
    if expected == 0:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype, count=count).reshape(shape)
