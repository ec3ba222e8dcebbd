"""`moemesh demo`: build the demo model if absent, bring the mesh up (control, 2 expert servers,
attention, router), stream an answer to a fixed question, shut everything down."""
from __future__ import annotations

import argparse
import sys

QUESTION = "What is the capital of France?"


def register(subparsers) -> None:
    from moemesh.cli.up import add_mesh_arguments

    p = subparsers.add_parser("demo", help="build the demo model, bring the mesh up, stream one answer, shut down")
    p.add_argument("--question", default=QUESTION, help="the user message to answer")
    p.add_argument("--max-new-tokens", type=int, default=64, metavar="N")
    add_mesh_arguments(p)
    p.set_defaults(func=run)


def progress(message: str) -> None:
    print(f"moemesh demo: {message}", file=sys.stderr, flush=True)


def run(ns: argparse.Namespace) -> int:
    import grpc

    from moemesh.cli.checks import check_at_least
    from moemesh.cli.up import mesh_config
    from moemesh.launcher.mesh import Mesh, MeshFailed

    # a bad flag: one line naming it from moemesh.cli.main, status 2
    check_at_least("--max-new-tokens", ns.max_new_tokens, 1)
    if not getattr(ns, "model_dir", ""):
        progress("preparing the demo model (built once, then cached)")
    cfg = mesh_config(ns, progress=progress)
    mesh = Mesh(cfg.mesh, cfg.log_dir)
    progress(f"starting control, {cfg.mesh.expert_servers} expert servers, attention and router (logs in {mesh.log_dir})")
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
