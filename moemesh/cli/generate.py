"""`moemesh generate`: the gRPC client of a running mesh; `--json` prints what `moemesh run --json` does."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from moemesh.cli.checks import check_address, check_timeout
from moemesh.cli.client_args import RouterClientArgs, add_client_arguments, client_args
from moemesh.cli.prompt_args import PromptArgs
from moemesh.svc_config import add_arguments, from_sources

PROMPT_FIELDS = {f.name for f in dataclasses.fields(PromptArgs)}


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate through a running mesh's router (gRPC client)")
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router's address")
    add_arguments(p, PromptArgs, None)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--model", default="", help="model name to ask for (default: whatever the mesh serves)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline for the whole request")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_client_arguments(p, RouterClientArgs)
    p.set_defaults(func=run)


def prompt_args(ns: argparse.Namespace) -> PromptArgs:
    """The prompt and sampling flags of a parsed `generate` (or `run`) command line."""
    return from_sources(PromptArgs, None, argparse.Namespace(**{k: v for k, v in vars(ns).items() if k in PROMPT_FIELDS}))


def run(ns: argparse.Namespace) -> int:
    """Errors (bad flags, a refused or failed call) reach `moemesh.cli.main`, which prints one line."""
    check_address("--addr", ns.addr)
    check_timeout("--timeout", ns.timeout)
    return generate(ns, prompt_args(ns), client_args(RouterClientArgs, ns))


def generate(ns: argparse.Namespace, args: PromptArgs, client: RouterClientArgs) -> int:
    from moemesh.rpc.server import make_sync_channel
    from moemesh.rpc.generation import Completion, build_request, pb, pb_grpc

    with make_sync_channel(ns.addr, client.rpc(), api_key=client.api_key) as channel:
        stub = pb_grpc.GenerationStub(channel)
        ids = args.token_ids
        prompt = {"prompt_token_ids": ids} if ids is not None else {"prompt": args.prompt}
        if ids is None and not args.raw_prompt:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=ns.timeout or 30)
            if info.has_chat_template:
                prompt = {"messages": [("user", args.prompt)]}
        req = build_request(
            **prompt, max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.seed, stop=ns.stop, logprobs=ns.json, prompt_logprobs=ns.json, model=ns.model,
        )
        done = Completion()
        for resp in stub.Generate(req, timeout=ns.timeout):
            delta = done.add(resp)
            if not ns.json:
                sys.stdout.write(delta if delta or resp.finish_reason else "")
                sys.stdout.flush()
    if ns.json:
        print(json.dumps(done.to_json()))
    else:
        sys.stdout.write("\n")
    return 0
