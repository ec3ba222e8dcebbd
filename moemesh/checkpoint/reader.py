"""`CheckpointReader`: reads named tensors from a Hugging Face safetensors checkpoint on demand.

Files are read with positional reads (`SafetensorsFile`), not memory-mapped, so a weight the model
copies into another layout is not also held as mapped pages; only requested tensors are read. The
language model of a multimodal checkpoint is also readable under the causal-LM names (nesting.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

import torch

from moemesh.checkpoint.errors import CheckpointError
from moemesh.checkpoint.nesting import language_model_aliases
from moemesh.checkpoint.safetensors_file import SafetensorsFile, SafetensorsHeaderError, TensorEntry

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SCALED_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)  # stored values that need a scale to mean a weight


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
        t = self._read(name)
        return t if dtype is None or t.dtype == dtype else t.to(dtype)

    def read_into(self, name: str, out: torch.Tensor) -> None:
        """Copies tensor `name` into `out` (its shape must be the tensor's; cast to out's dtype, moved to
        out's device). A contiguous CPU `out` of the stored dtype is filled straight from the file."""
        self._check(name, out.shape, out.dtype)
        shard = self._shard_of(name)
        if out.dtype == self._entry(name).dtype and out.device.type == "cpu" and out.is_contiguous():
            try:
                self._open(shard).read_into(self._stored.get(name, name), out)
            except OSError as e:
                raise CheckpointError(f"cannot read tensor {name!r} from {shard!r} (corrupt file?): {e}") from e
        else:
            out.copy_(self._read(name))

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
        try:
            return self._open(shard).read(self._stored.get(name, name))
        except OSError as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {shard!r} (corrupt file?): {e}") from e
