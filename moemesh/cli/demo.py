"""`moemesh demo`: build the demo model if absent, bring the mesh up (control, 2 expert servers,
attention, router), stream an answer to a fixed question, shut everything down."""
from __future__ import annotations

import argparse
import sys

QUESTION = "What is the capital of France?"


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="build the demo model, bring the mesh up, stream one answer, shut down")
    p.add_argument("--question", default=QUESTION, help="the user message to answer")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    p.add_argument("--expert-servers", type=int, default=2, metavar="N")
    p.add_argument("--transport", choices=("grpc", "dist", "auto"), default="grpc",
                   help="attention <-> expert transport (auto: torch.distributed on this node, gRPC across nodes)")
    p.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the demo model, built if absent)")
    p.set_defaults(func=run)


def progress(message: str) -> None:
    print(f"moemesh demo: {message}", file=sys.stderr, flush=True)


def run(ns: argparse.Namespace) -> int:
    import grpc

    from moemesh.cli.checks import check_at_least, check_model_dir
    from moemesh.launcher.mesh import Mesh, MeshFailed, MeshSpec

    check_at_least("--max-new-tokens", ns.max_new_tokens, 1)
    check_at_least("--expert-servers", ns.expert_servers, 1)
    if ns.model is not None:
        check_model_dir("--model", ns.model)
    model = ns.model
    if model is None:
        from moemesh.demo_model import ensure_demo_model

        progress("preparing the demo model (built once, then cached)")
        model = str(ensure_demo_model(progress=progress))
    mesh = Mesh(MeshSpec(model_dir=model, expert_servers=ns.expert_servers, transport=ns.transport))
    progress(f"starting control, {ns.expert_servers} expert servers, attention and router (logs in {mesh.log_dir})")
    try:
        router, control = mesh.start()
        progress(f"serving router={router} control={control}")
        print(f"user: {ns.question}\nassistant: ", end="", flush=True)
        ask(router, ns.question, ns.max_new_tokens)
        return 0
    except MeshFailed as e:
        print(f"moemesh demo: error: {e}", file=sys.stderr)
        return 1
    except grpc.RpcError as e:
        print(f"\nmoemesh demo: error: {e.code().name}: {e.details()}", file=sys.stderr)
        return 1
    finally:
        progress("shutting the mesh down")
        mesh.stop()


def ask(router: str, question: str, max_new_tokens: int) -> None:
    import os

    from moemesh.rpc.config import RpcConfig
    from moemesh.rpc.server import make_sync_channel
    from moemesh.rpc.generation import build_request, pb_grpc

    # the mesh's router asks for the API key its children inherited (MOEMESH_API_KEY), if any
    with make_sync_channel(router, RpcConfig(), api_key=os.environ.get("MOEMESH_API_KEY", "")) as channel:
        stub = pb_grpc.GenerationStub(channel)
        req = build_request(messages=[("user", question)], max_new_tokens=max_new_tokens, temperature=0.0)
        for resp in stub.Generate(req, timeout=600):
            sys.stdout.write(resp.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
