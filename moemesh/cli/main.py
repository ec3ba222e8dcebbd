"""`moemesh` entry point. Each subcommand lives in its own module exposing
`register(subparsers) -> None`, which adds its parser and sets `func(args) -> int`.

Every error is one line on stderr, `moemesh COMMAND: error: ...`, naming the flag or file, never a
traceback: exit status 2 for a bad flag, file or value (argparse's own errors included: usage
is left to `--help`), and for a request the mesh refused as invalid; 1 when something failed at
run time (a mesh that cannot be reached, a service that broke).
"""
from __future__ import annotations

import argparse
import importlib
import re
import sys
from typing import NoReturn

from moemesh.errors import USAGE_ERRORS
from moemesh.svc_config import OneLineParser

# Subcommand modules, in the order `--help` lists them.
SUBCOMMANDS = [
    "moemesh.cli.run",
    "moemesh.cli.demo_model",
    "moemesh.cli.serve", "moemesh.cli.up", "moemesh.cli.generate", "moemesh.cli.demo", "moemesh.cli.bench",
    "moemesh.cli.ctl",
]
# Names errors use for what a flag sets, where the flag's own name differs.
FIELD_ALIASES = {"prompt_token_ids": "prompt_ids"}
LEADING_FIELD = re.compile(r"^(?:config field )?([a-z][a-z0-9_]*)\b")


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="moemesh", description="moemesh: serve Mixture-of-Experts LLMs with disaggregated experts")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name in SUBCOMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def chosen_parser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> argparse.ArgumentParser:
    """The (sub)parser of the command line that was parsed: `moemesh serve router`, `moemesh ctl set`..."""
    while True:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or getattr(args, subs[0].dest, None) not in subs[0].choices:
            return parser
        parser = subs[0].choices[getattr(args, subs[0].dest)]


def name_the_flag(message: str, parser: argparse.ArgumentParser, service: str | None = None) -> str:
    """An error that starts with a config field's name ("capacity_factor must be ...",
    "temperature: ...") starts with its flag instead ("--capacity-factor must be ..."); for a service
    (`moemesh serve X`) the environment variable that sets it too."""
    from moemesh.svc_config import env_name

    flags = {a.dest: a.option_strings[0] for a in parser._actions if a.option_strings and a.dest != "help"}
    m = LEADING_FIELD.match(message)
    if not m or message.startswith("config field"):
        return message
    name = FIELD_ALIASES.get(m.group(1), m.group(1)) if m.group(1) not in flags else m.group(1)
    if name not in flags:
        return message
    where = f"{flags[name]} (or env {env_name(service, name)})" if service else flags[name]
    return where + message[m.end(1):]


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    used = chosen_parser(parser, args)
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except USAGE_ERRORS as exc:
        service = getattr(args, "service", None) if args.command == "serve" else None
        return fail(used.prog, name_the_flag(str(exc) or type(exc).__name__, used, service), 2)
    except Exception as exc:  # noqa: BLE001 - one line, never a traceback
        import grpc

        if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):  # the mesh's message names the field: here, its flag
            return fail(used.prog, f"{exc.code().name}: {name_the_flag(exc.details() or '', used)}", rpc_exit_status(exc.code()))
        return fail(used.prog, f"{type(exc).__name__}: {exc}", 1)


def rpc_exit_status(code) -> int:
    """2 when the mesh refused the request itself as invalid, else 1."""
    import grpc

    invalid = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.NOT_FOUND,
               grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.FAILED_PRECONDITION)
    return 2 if code in invalid else 1


def fail(prog: str, message: str, status: int) -> int:
    print(f"{prog}: error: {one_line(message)}", file=sys.stderr, flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
