"""Build the demo checkpoint idempotently and atomically (temp dir, then rename)."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Callable

from moemesh.demo_model.convert import DTYPES, MODEL_FILES, convert_gguf_to_mixtral
from moemesh.demo_model.locate import default_demo_dir, find_demo_gguf

DEMO_NUM_EXPERTS = 8
# A GGUF without a chat template gives a model without chat_template.jinja; the rest is required.
REQUIRED_FILES = tuple(name for name in MODEL_FILES if name != "chat_template.jinja")


def is_complete(out_dir: Path, dtype: str) -> bool:
    """Whether `out_dir` holds every file of a converted Mixtral model stored in `dtype`."""
    out_dir = Path(out_dir)
    if not all((out_dir / name).is_file() for name in REQUIRED_FILES):
        return False
    try:
        cfg = json.loads((out_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError):
        return False
    return cfg.get("architectures") == ["MixtralForCausalLM"] and cfg.get("dtype") == dtype


def _looks_replaceable(out_dir: Path) -> bool:
    """An existing directory may be replaced only if it is empty or holds a model (never other data)."""
    entries = list(out_dir.iterdir())
    return not entries or (out_dir / "config.json").is_file() or any(e.name in MODEL_FILES for e in entries)


def build_demo_model(
    out_dir: str | Path,
    dtype: str = "float32",
    force: bool = False,
    gguf_path: str | Path | None = None,
    progress: Callable[[str], None] = lambda msg: None,
) -> Path:
    """Build the 8-expert demo Mixtral into `out_dir`; skip when it is already there (unless `force`).

    The model is written to a sibling temp directory and renamed into place, so `out_dir` never holds
    a partial model.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    out_dir = Path(out_dir).expanduser().absolute()
    if out_dir.exists() and not out_dir.is_dir():
        raise ValueError(f"out_dir {out_dir} exists and is not a directory")
    if not force and is_complete(out_dir, dtype):
        progress(f"{out_dir} already holds the demo model ({dtype}); skipping (use --force to rebuild)")
        return out_dir
    if out_dir.is_dir() and not _looks_replaceable(out_dir):
        raise ValueError(f"out_dir {out_dir} is a non-empty directory that holds no model; refusing to replace it")
    source = Path(gguf_path) if gguf_path is not None else find_demo_gguf()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        convert_gguf_to_mixtral(source, tmp, dtype=dtype, num_experts=DEMO_NUM_EXPERTS, progress=progress)
        if not force and is_complete(out_dir, dtype):
            # Another process finished the same build meanwhile: keep its copy (readers may hold it).
            progress(f"{out_dir} was built concurrently; keeping that copy")
            return out_dir
        if out_dir.exists():
            os.replace(out_dir, old)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if old.exists() and not out_dir.exists():
                os.replace(old, out_dir)  # put the previous model back
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    progress(f"wrote {out_dir}")
    return out_dir


def ensure_demo_model(dtype: str = "float32", out_dir: str | Path | None = None, progress: Callable[[str], None] = lambda msg: None) -> Path:
    """The demo model's directory (`default_demo_dir()` unless given), built first if absent."""
    return build_demo_model(out_dir if out_dir is not None else default_demo_dir(), dtype=dtype, progress=progress)
