"""The engine's device: validating `cpu` / `cuda[:N]`, making it current, and placing tensors on it.

Weights are read through a `DeviceReader` (every checkpoint tensor moved to the device as it is read)
and the model is built and stepped inside `on_device(device)`, so every factory call without an
explicit device (`torch.empty/zeros/arange/tensor`, ...) allocates there. On the CPU `on_device` is
a no-op, so the CPU path runs exactly as before.
"""
from __future__ import annotations

import contextlib
import re
from typing import Iterable

import torch

_DEVICE = re.compile(r"^(cpu|cuda(:\d+)?)$")


def device_format_error(spec: str) -> str | None:
    """None when `spec` reads as a device the engine accepts (`cpu`, `cuda`, `cuda:N`), else why not."""
    if not isinstance(spec, str) or not _DEVICE.match(spec):
        return f"device must be cpu, cuda or cuda:N, got {spec!r}"
    return None


def check_device(spec: str) -> None:
    """ValueError naming `device` when `spec` is malformed or names a CUDA device this machine lacks."""
    error = device_format_error(spec)
    if error:
        raise ValueError(error)
    if spec == "cpu":
        return
    if not torch.cuda.is_available():
        raise ValueError(f"device {spec!r}: CUDA is not available on this machine")
    index = torch.device(spec).index
    if index is not None and index >= torch.cuda.device_count():
        raise ValueError(f"device {spec!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def select_device(spec: str) -> torch.device:
    """The torch.device for `spec`; for CUDA, makes it the current device (call before any allocation)."""
    check_device(spec)
    device = torch.device(spec)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def on_device(device: torch.device):
    """Context in which factory calls without a device allocate on `device` (nothing changes on the CPU)."""
    return contextlib.nullcontext() if device.type == "cpu" else torch.device(device)


class DeviceReader:
    """A checkpoint reader whose `get` returns tensors on `device`; everything else is the wrapped reader's."""

    def __init__(self, reader, device: torch.device) -> None:
        self._reader = reader
        self.device = device

    def get(self, name: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        return self._reader.get(name, shape=shape, dtype=dtype).to(self.device)

    def __getattr__(self, name: str):
        return getattr(self._reader, name)
