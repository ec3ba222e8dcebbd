"""`CheckpointReader`: reads named tensors from a Hugging Face safetensors checkpoint on demand.

Files are opened with `safetensors.safe_open` (memory-mapped); only requested tensors are read. The
language model of a multimodal checkpoint is also readable under the causal-LM names (nesting.py).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch
from safetensors import safe_open

from moemesh.checkpoint.errors import CheckpointError
from moemesh.checkpoint.nesting import language_model_aliases

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
        self._handles: dict[str, Any] = {}  # shard file name -> open safetensors handle
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
        return {name: SINGLE_FILE for name in self._open(SINGLE_FILE).keys()}

    def _open(self, shard: str):
        handle = self._handles.get(shard)
        if handle is None:
            path = self.model_dir / shard
            try:
                handle = safe_open(str(path), framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types for bad headers
                raise CheckpointError(f"cannot read safetensors file {str(path)!r} (corrupt header?): {e}") from e
            self._handles[shard] = handle
        return handle

    def keys(self) -> list[str]:
        return sorted(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._open(self._shard_of(name)).get_slice(self._stored.get(name, name)).get_shape())

    def _shard_of(self, name: str) -> str:
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name!r} not found in checkpoint {str(self.model_dir)!r}")
        return shard

    def get(self, name: str, shape: Iterable[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor `name`, checked against `shape` when given, cast to `dtype` when given."""
        shard = self._shard_of(name)
        if shape is not None:
            expected = tuple(int(s) for s in shape)
            got = self.shape(name)
            if got != expected:
                raise CheckpointError(f"tensor {name!r} has shape {list(got)}, expected {list(expected)}")
        try:
            t = self._open(shard).get_tensor(self._stored.get(name, name))
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name!r} from {shard!r} (corrupt file?): {e}") from e
        if dtype is not None and t.dtype != dtype and t.dtype in SCALED_DTYPES:
            # an FP8 value means nothing without its scale; fp8_dequant reads the scaled ones as stored
            raise CheckpointError(
                f"tensor {name!r} is stored as {t.dtype} and read as {dtype} with no scale; the checkpoint's "
                "quantization_config does not declare the format that holds its scale"
            )
        return t if dtype is None or t.dtype == dtype else t.to(dtype)
