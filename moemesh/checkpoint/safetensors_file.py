"""`SafetensorsFile`: one safetensors file read with plain positional reads, never memory-mapped.

A memory-mapped file keeps every page a load touched in the process's resident set for as long as
any tensor views the mapping, so a model that copies its weights into another layout (the experts'
stacked [E, 2I, H], the attention's fused qkv) would hold the weights twice: the copy and the mapped
pages. Reading each tensor's bytes straight into the memory that keeps it (`read_into`), or into a
fresh tensor (`read`), holds them once; the page cache still serves a second load.

Format: an 8-byte little-endian header length n, n bytes of JSON {name: {dtype, shape, data_offsets:
[begin, end]}, "__metadata__": {...}}, then the data; offsets count from the end of the header.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_READ_BYTES = 1 << 30  # one pread at most (Linux caps a read near 2 GiB)
DTYPES = {
    name: getattr(torch, attr)
    for name, attr in (
        ("BOOL", "bool"), ("U8", "uint8"), ("I8", "int8"), ("I16", "int16"), ("U16", "uint16"), ("F16", "float16"),
        ("BF16", "bfloat16"), ("I32", "int32"), ("U32", "uint32"), ("F32", "float32"), ("F64", "float64"),
        ("I64", "int64"), ("U64", "uint64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
        ("F8_E8M0", "float8_e8m0fnu"),
    )
    if hasattr(torch, attr)
}


class SafetensorsHeaderError(ValueError):
    """The file is not a readable safetensors file (the message says what is wrong)."""


@dataclass(frozen=True)
class TensorEntry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute file offset of the first byte
    nbytes: int


class SafetensorsFile:
    """The header of one file, parsed once; tensors are read on demand with `os.pread`."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            self.entries = self._read_header()
        except BaseException:
            os.close(self._fd)
            self._fd = None  # closed once: the number may be another file's by the time __del__ runs
            raise

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)
            self._fd = None

    def _read_header(self) -> dict[str, TensorEntry]:
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise SafetensorsHeaderError(f"{size} bytes, shorter than the 8-byte header length")
        (n,) = struct.unpack("<Q", head)
        if n > min(size - 8, MAX_HEADER_BYTES):
            raise SafetensorsHeaderError(f"header length {n} does not fit the file ({size} bytes)")
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise SafetensorsHeaderError(f"header is not JSON: {e}") from e
        if not isinstance(header, dict):
            raise SafetensorsHeaderError("header is not a JSON object")
        data_start, data_bytes = 8 + n, size - 8 - n
        entries = {}
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            try:
                dtype = DTYPES[meta["dtype"]]
                shape = tuple(int(s) for s in meta["shape"])
                begin, end = (int(o) for o in meta["data_offsets"])
            except (KeyError, TypeError, ValueError) as e:
                raise SafetensorsHeaderError(f"entry {name!r} is malformed: {e!r}") from e
            numel = 1
            for s in shape:
                numel *= s
            if min(shape, default=0) < 0 or not 0 <= begin <= end <= data_bytes or end - begin != numel * dtype.itemsize:
                raise SafetensorsHeaderError(f"entry {name!r}: offsets [{begin}, {end}) do not hold {meta['dtype']} {list(shape)}")
            entries[name] = TensorEntry(dtype, shape, data_start + begin, end - begin)
        return entries

    def read(self, name: str) -> torch.Tensor:
        """A fresh tensor holding `name` as stored."""
        e = self.entries[name]
        out = torch.empty(e.shape, dtype=e.dtype, device="cpu")  # host memory even under a default-device context
        self._read_bytes(e, out)
        return out

    def read_into(self, name: str, out: torch.Tensor, begin: int = 0, end: int | None = None) -> None:
        """Reads `name` into `out`, a contiguous CPU tensor of its dtype and number of elements; with
        `begin`/`end`, only the tensor's bytes [begin, end) (end clipped to its size), into the same
        bytes of `out`."""
        e = self.entries[name]
        if out.dtype != e.dtype or out.device.type != "cpu" or not out.is_contiguous() or out.numel() * out.element_size() != e.nbytes:
            raise ValueError(f"read_into {name!r}: out must be a contiguous CPU {e.dtype} tensor of {list(e.shape)} elements")
        end = e.nbytes if end is None else min(end, e.nbytes)
        if not 0 <= begin <= end:
            raise ValueError(f"read_into {name!r}: byte range [{begin}, {end}) is outside its {e.nbytes} bytes")
        self._read_bytes(e, out, begin, end)

    def _read_bytes(self, e: TensorEntry, out: torch.Tensor, begin: int = 0, end: int | None = None) -> None:
        end = e.nbytes if end is None else end
        if end == begin:
            return
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())  # the tensor's own bytes
        done = begin
        while done < end:
            got = os.preadv(self._fd, [view[done : min(end, done + MAX_READ_BYTES)]], e.begin + done)
            if got <= 0:
                raise OSError(f"{self.path}: read ended {end - done} bytes early (file truncated?)")
            done += got
