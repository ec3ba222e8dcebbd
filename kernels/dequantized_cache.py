"""An opt-in, caller-owned store of dequantized expert weights: memory for speed.

By default `grouped_expert_mlp` dequantizes the quantized experts that receive rows on every call and
keeps nothing. A caller that can afford dense copies (2 bytes per weight in bfloat16, 4 in float32:
about 4x an MXFP4/NVFP4 layer, 2-4x an FP8 one) creates one `DequantizedWeights`, owns it, and
passes it as `grouped_expert_mlp(..., cache=it)`; each expert is then dequantized once, on its first
call, and served from the store afterwards. Values are exactly those of `dequantize`, and the
grouped GEMM runs on them in the same groups, so outputs are the same with or without the store.

An entry is one projection (one quantized experts object) in one compute dtype, [E, rows, cols],
filled expert by expert as experts receive rows. It keeps its source object alive, so the object's
identity (the key) cannot be reused while cached. Entries beyond `max_bytes` are evicted, least
recently used first; `clear()` drops everything (call it after replacing a layer's weights).
Thread-safe: one lock around lookups and fills.

Shape legend: E experts held, g experts asked for, rows x cols one expert's weight matrix.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from kernels.formats import FP8BlockExperts, MXFP4Experts, NVFP4Experts

_QUANTIZED = (FP8BlockExperts, MXFP4Experts, NVFP4Experts)


@dataclass
class _Entry:
    source: object  # the quantized experts: keeps id(source) from being reused while cached
    dense: Tensor  # [E, rows, cols]
    filled: list[bool]  # [E]


class DequantizedWeights:
    """Dense copies of quantized expert weights, per (experts object, dtype); see the module doc."""

    def __init__(self, max_bytes: int | None = None) -> None:
        if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes: expected a non-negative int or None, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[int, torch.dtype], _Entry] = OrderedDict()
        self._lock = threading.Lock()

    @property
    def nbytes(self) -> int:
        """Bytes of dense weights held."""
        with self._lock:
            return sum(e.dense.nbytes for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def experts(self, t, dtype: torch.dtype, ids: Tensor) -> Tensor:
        """t: quantized experts [E, rows, cols] (dense tensors pass through `dequantized`); ids [g]
        int64 -> [g, rows, cols] in dtype, equal to `t.dequantize(dtype, ids)`. Consecutive ascending ids
        give a view into the store, others a copy."""
        from kernels.experts import dequantized

        if not isinstance(t, _QUANTIZED):
            return dequantized(t, dtype, ids)
        e, rows, cols = t.shape
        size = e * rows * cols * torch.empty((), dtype=dtype).element_size()
        if self.max_bytes is not None and size > self.max_bytes:
            return t.dequantize(dtype, ids)
        wanted = [int(i) for i in ids.tolist()]
        with self._lock:
            entry = self._entry(t, dtype, size)
            missing = [i for i in dict.fromkeys(wanted) if not entry.filled[i]]
            if missing:
                idx = torch.tensor(missing, device=entry.dense.device)
                entry.dense.index_copy_(0, idx, t.dequantize(dtype, idx))
                for i in missing:
                    entry.filled[i] = True
            dense = entry.dense
        if wanted and wanted == list(range(wanted[0], wanted[0] + len(wanted))):
            return dense.narrow(0, wanted[0], len(wanted))
        return dense.index_select(0, ids.to(device=dense.device, dtype=torch.long))

    def _entry(self, t, dtype: torch.dtype, size: int) -> _Entry:
        """The entry of (t, dtype), created (and older ones evicted) if absent; the lock is held."""
        key = (id(t), dtype)
        entry = self._entries.get(key)
        if entry is not None and entry.source is t:
            self._entries.move_to_end(key)
            return entry
        if self.max_bytes is not None:
            held = sum(x.dense.nbytes for x in self._entries.values())
            while self._entries and held + size > self.max_bytes:
                held -= self._entries.popitem(last=False)[1].dense.nbytes
        dense = torch.empty(t.shape, dtype=dtype, device=t.device)
        entry = _Entry(t, dense, [False] * t.shape[0])
        self._entries[key] = entry
        return entry
