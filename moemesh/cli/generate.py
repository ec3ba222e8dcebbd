"""`moemesh generate`: the gRPC client of a running mesh; `--json` prints what `moemesh run --json` does."""
from __future__ import annotations

import argparse
import json
import sys

from moemesh.cli.prompt_args import add_prompt_and_sampling_args


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="generate through a running mesh's router (gRPC client)")
    p.add_argument("--addr", required=True, metavar="HOST:PORT", help="the router's address")
    add_prompt_and_sampling_args(p)
    p.add_argument("--stop", action="append", default=[], metavar="TEXT", help="stop string (repeatable)")
    p.add_argument("--model", default="", help="model name to ask for (default: whatever the mesh serves)")
    p.add_argument("--timeout", type=float, default=None, metavar="S", help="deadline for the whole request")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    import grpc

    from moemesh.cli.run import parse_prompt_ids

    try:
        ids = parse_prompt_ids(ns.prompt_ids) if ns.prompt_ids is not None else None
    except ValueError as e:
        print(f"moemesh generate: error: {e}", file=sys.stderr)
        return 2
    try:
        return generate(ns, ids)
    except grpc.RpcError as e:
        print(f"moemesh generate: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1


def generate(ns: argparse.Namespace, prompt_ids) -> int:
    import grpc

    from moemesh.rpc.config import RpcConfig
    from moemesh.rpc.generation import Completion, build_request, pb, pb_grpc

    with grpc.insecure_channel(ns.addr, options=RpcConfig().channel_options()) as channel:
        stub = pb_grpc.GenerationStub(channel)
        prompt = {"prompt_token_ids": prompt_ids} if prompt_ids is not None else {"prompt": ns.prompt}
        if prompt_ids is None and not ns.raw_prompt:
            info = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=ns.timeout or 30)
            if info.has_chat_template:
                prompt = {"messages": [("user", ns.prompt)]}
        req = build_request(
            **prompt, max_new_tokens=ns.max_new_tokens, temperature=ns.temperature, top_p=ns.top_p,
            top_k=ns.top_k, seed=ns.seed, stop=ns.stop, logprobs=ns.json, prompt_logprobs=ns.json, model=ns.model,
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
