"""`moemesh` entry point. Each subcommand lives in its own module exposing
`register(subparsers) -> None`, which adds its parser and sets `func(args) -> int`."""
from __future__ import annotations

import argparse
import importlib
import sys

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = [
    "moemesh.cli.run",
    "moemesh.cli.demo_model",
    "moemesh.cli.serve", "moemesh.cli.up", "moemesh.cli.generate", "moemesh.cli.demo", "moemesh.cli.bench",
    "moemesh.cli.ctl",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="moemesh", description="moemesh: serve Mixture-of-Experts LLMs with disaggregated experts")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
