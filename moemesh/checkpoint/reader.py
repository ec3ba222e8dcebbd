"""`CheckpointReader`: reads named tensors from a Hugging Face safetensors checkpoint on demand.

Files are read with positional reads (`SafetensorsFile`), not memory-mapped, so a weight the model
copies into another layout is not also held as mapped pages; only requested tensors are read. Reads
run on one thread per CPU this process may use (at most MAX_READ_THREADS): each thread faults its
own part of the fresh destination memory in, and where the host backs a virtual machine's memory on
first touch those faults are most of a load's time (two threads took them about 3x faster than one:
docs/benchmarks.md, "Load"). The language model of a multimodal checkpoint is also readable under
the causal-LM names (nesting.py).
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Iterable, Sequence

import torch

from moemesh.checkpoint.errors import CheckpointError
from moemesh.checkpoint.nesting import language_model_aliases
from moemesh.checkpoint.safetensors_file import SafetensorsFile, SafetensorsHeaderError, TensorEntry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # stored values that need a scale to mean a weight
READ_CHUNK_BYTES = 8 << 20  # a tensor read straight into place is split into reads of at most this many bytes
MAX_READ_THREADS = 8


def default_read_threads() -> int:
    """One per CPU this process may run on, at most MAX_READ_THREADS."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(MAX_READ_THREADS, cpus))


class CheckpointReader:
    """Tensor name -> shard map of one model directory; shards are opened lazily, once each."""

    def __init__(self, model_dir: str | Path) -> None:
        self.model_dir = Path(model_dir)
        if not self.model_dir.is_dir():
            raise CheckpointError(f"model directory {str(self.model_dir)!r} does not exist")
        if not (self.model_dir / "config.json").is_file():
            raise CheckpointError(f"config.json not found in {str(self.model_dir)!r}")
        self._handles: dict[str, SafetensorsFile] = {}  # shard file name -> its parsed header and open file
        self._weight_map = self._read_weight_map()
        self._stored = language_model_aliases(self._weight_map)  # causal-LM name -> stored name
        self._weight_map.update({alias: self._weight_map[name] for alias, name in self._stored.items()})

    def _read_weight_map(self) -> dict[str, str]:
        index = self.model_dir / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from e
            for shard in sorted(set(weight_map.values())):
                if not (self.model_dir / shard).is_file():
                    raise CheckpointError(f"{INDEX_FILE} in {str(self.model_dir)!r} names shard {shard!r}, which is missing")
            return dict(weight_map)
        single = self.model_dir / SINGLE_FILE
        if not single.is_file():
            raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {str(self.model_dir)!r}")
        return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).entries}

    def _open(self, shard: str) -> SafetensorsFile:
        handle = self._handles.get(shard)
        if handle is None:
            path = self.model_dir / shard
            try:
                handle = SafetensorsFile(path)
            except (OSError, SafetensorsHeaderError) as e:
                raise CheckpointError(f"cannot read safetensors file {str(path)!r} (corrupt header?): {e}") from e
            self._handles[shard] = handle
        return handle

    def keys(self) -> list[str]:
        return sorted(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entry(name).shape

    def _shard_of(self, name: str) -> str:
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {str(self.model_dir)!r}")
        return shard

    def _entry(self, name: str) -> TensorEntry:
        shard = self._shard_of(name)
        entry = self._open(shard).entries.get(self._stored.get(name, name))
        if entry is None:
            raise CheckpointError(f"tensor {name!r} is in the index but not in its shard {shard!r}")
        return entry

    def get(self, name: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name` (a fresh CPU tensor), checked against `shape` when given, cast to `dtype` when given."""
        self._check(name, shape, dtype)
        entry = self._entry(name)
        t = torch.empty(entry.shape, dtype=entry.dtype, device="cpu")  # host memory even under a default-device context
        self.read_all_into([(name, t)])
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def get_stacked(self, names: Sequence[str], shape: Iterable[int] | None = None) -> torch.Tensor:
        """[len(names), *shape] of tensors of one stored dtype and shape (`shape` checked when given),
        as stored, each read straight into its place."""
        if not names:
            raise ValueError("get_stacked needs at least one name")
        first = self._entry(names[0])
        out = torch.empty(len(names), *first.shape, dtype=first.dtype, device="cpu")
        self._check(names[0], shape, None)
        self.read_all_into(list(zip(names, out)))  # a different shape or dtype fails the check there
        return out

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copies tensor `name` into `out` (its shape must be the tensor's; cast to out's dtype, moved to
        out's device). A contiguous CPU `out` of the stored dtype is filled straight from the file."""
        self.read_all_into([(name, out)])

    def read_all_into(self, pairs: Sequence[tuple[str, torch.Tensor]], threads: int | None = None) -> None:
        """`read_into(name, out)` for every pair, on `threads` threads (None: `default_read_threads()`).
        Every pair is checked before anything is read; a tensor read straight into place is split into
        reads of at most READ_CHUNK_BYTES, so one large tensor is read by every thread too."""
        for name, out in pairs:
            self._check(name, out.shape, out.dtype)  # also opens each shard, here on one thread
        reads = []  # () -> None each
        for name, out in pairs:
            entry = self._entry(name)
            if out.dtype == entry.dtype and out.device.type == "cpu" and out.is_contiguous():
                handle, stored = self._open(self._shard_of(name)), self._stored.get(name, name)
                reads += [
                    partial(self._guarded, name, handle.read_into, stored, out, begin, begin + READ_CHUNK_BYTES)
                    for begin in range(0, max(entry.nbytes, 1), READ_CHUNK_BYTES)
                ]
            else:  # cast or moved: read as stored, then copied
                reads.append(partial(lambda n, o: o.copy_(self._read(n)), name, out))
        threads = max(1, min(len(reads), default_read_threads() if threads is None else threads))
        if threads == 1:
            for read in reads:
                read()
            return
        inference = torch.is_inference_mode_enabled()  # thread-local: the pool's threads take the caller's

        def run(read) -> None:
            with torch.inference_mode(inference):
                read()

        with ThreadPoolExecutor(threads, thread_name_prefix="checkpoint-read") as pool:
            for done in [pool.submit(run, read) for read in reads]:
                done.result()  # the first failure raises; leaving the pool waits for the other reads

    def _guarded(self, name: str, read, *args):
        """read(*args), its OSError named as a CheckpointError."""
        try:
            return read(*args)
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {self._shard_of(name)!r} (corrupt file?): {e}") from e

    def _check(self, name: str, shape: Iterable[int] | None, dtype: torch.dtype | None) -> None:
        entry = self._entry(name)
        if shape is not None:
            expected = tuple(int(s) for s in shape)
            if entry.shape != expected:
                raise CheckpointError(f"tensor {name!r} has shape {list(entry.shape)}, expected {list(expected)}")
        if dtype is not None and entry.dtype != dtype and entry.dtype in SCALED_DTYPES:
            # an FP8 value means nothing without its scale; fp8_dequant reads the scaled ones as stored
            raise CheckpointError(
                f"tensor {name!r} is stored as {entry.dtype} and read as {dtype} with no scale; the checkpoint's "
                "quantization_config does not declare the format that holds its scale"
            )

    def _read(self, name: str) -> torch.Tensor:
        shard = self._shard_of(name)
        self._entry(name)
        return self._guarded(name, self._open(shard).read, self._stored.get(name, name))
