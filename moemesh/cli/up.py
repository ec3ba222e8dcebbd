"""`moemesh up`: the whole mesh on this machine, as separate processes, until SIGINT/SIGTERM.
A child that dies is restarted (with backoff) and rejoins; one that keeps dying is reported failed
and the rest keep serving (exit 1 at the end)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from kernels.prepare import EXPERT_DTYPES


def add_mesh_arguments(p: argparse.ArgumentParser) -> None:
    """Flags shared by `up`, `demo` and `bench --mesh`."""
    p.add_argument("--model", default=None, metavar="DIR", help="Hugging Face model directory (default: the demo model)")
    p.add_argument("--expert-servers", type=int, default=2, metavar="N")
    p.add_argument("--attention-replicas", type=int, default=1, metavar="N")
    p.add_argument("--experts-dtype", choices=EXPERT_DTYPES, default=None, help="expert weight format (default: as stored)")
    p.add_argument("--transport", choices=("grpc", "dist", "auto"), default="grpc",
                   help="attention <-> expert transport (auto: torch.distributed on this node, gRPC across nodes)")
    p.add_argument("--attention-threads", type=int, default=0, metavar="N", help="torch threads per attention replica (0 = default)")
    p.add_argument("--expert-cpu-quota", type=float, default=0.0, metavar="CORES",
                   help="each expert server gets CORES CPUs of its own, as on separate machines: a cgroup with a CPU quota "
                        "(cgroup v2 cpu.max or v1 cfs quota, needs write access to /sys/fs/cgroup), else pinned cores; "
                        "its torch threads match (0 = no budget: every server may use every core)")
    p.add_argument("--start-timeout", type=float, default=600.0, metavar="S", help="how long each service may take to start")
    p.add_argument("--log-dir", default=None, metavar="DIR", help="where the services' logs go (default: a temp dir)")
    p.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                   help="attention replicas do not reuse the KV blocks of earlier prompts' shared prefixes")
    p.add_argument("--max-num-batched-tokens", type=int, default=0, metavar="N",
                   help="tokens per attention step: decodes first, then prompt chunks (0 = the replicas' default); "
                        "smaller keeps streams flowing while long prompts prefill")


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="start the whole mesh on this machine (control, experts, attention, router)")
    add_mesh_arguments(p)
    p.add_argument("--port", type=int, default=0, metavar="P", help="the router's port (0 = any free port)")
    p.add_argument("--http-port", type=int, default=None, metavar="P",
                   help="also start the HTTP gateway (OpenAI/Anthropic APIs, chat page) on this port (0 = any free port)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="the public API key: clients of the router (`authorization: Bearer KEY`) and of the gateway "
                        "(`Authorization: Bearer KEY` or `x-api-key: KEY`) must send it (default: MOEMESH_API_KEY, else none)")
    for name, what in (("cert", "PEM certificate every service presents"), ("key", "its PEM private key"),
                       ("ca", "PEM CA the services' certificates chain to")):
        p.add_argument(f"--tls-{name}", default=None, metavar="FILE", help=f"with --tls-cert/--tls-key/--tls-ca, mTLS between all services: {what}")
    p.add_argument("--tls-server-name", default=None, metavar="NAME", help="name the certificate carries when it is not the host dialed")
    p.set_defaults(func=run)


def mesh_spec(ns: argparse.Namespace, port: int = 0, http_port: int | None = None):
    """The mesh the flags describe; ValueError naming the flag when one is bad."""
    from moemesh.cli.checks import check_at_least, check_model_dir, check_timeout
    from moemesh.launcher.mesh import MeshSpec

    check_at_least("--attention-threads", ns.attention_threads, 0)
    check_timeout("--start-timeout", ns.start_timeout)
    model = ns.model
    if model is None:
        from moemesh.demo_model import ensure_demo_model

        model = str(ensure_demo_model())
    check_model_dir("--model", model)
    return MeshSpec(
        model_dir=model, expert_servers=ns.expert_servers, attention_replicas=ns.attention_replicas,
        experts_dtype=ns.experts_dtype, transport=ns.transport, port=port,
        start_timeout_s=ns.start_timeout, attention_threads=ns.attention_threads,
        prefix_cache=ns.prefix_cache, max_num_batched_tokens=ns.max_num_batched_tokens, http_port=http_port,
        expert_cpu_quota=ns.expert_cpu_quota, **security_fields(ns),
    )


def security_fields(ns: argparse.Namespace) -> dict:
    """`up`'s API key and TLS flags as MeshSpec fields (absent for commands without them)."""
    names = ("api_key", "tls_cert", "tls_key", "tls_ca", "tls_server_name")
    return {n: getattr(ns, n) for n in names if getattr(ns, n, None) is not None}


def run(ns: argparse.Namespace) -> int:
    from moemesh.launcher.mesh import Mesh, MeshFailed

    # a bad flag: one line naming it from moemesh.cli.main, status 2
    mesh = Mesh(mesh_spec(ns, ns.port, ns.http_port), ns.log_dir)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        router, control = mesh.start()
    except MeshFailed as e:
        print(f"moemesh up: error: {e}", file=sys.stderr)
        return 1
    http = f" http={mesh.http_addr}" if mesh.http_addr else ""
    print(f"moemesh: serving router={router} control={control}{http}", flush=True)
    print(f"moemesh up: the mesh token is in {mesh.token_file} (moemesh ctl --mesh-token-file {mesh.token_file} ...)",
          file=sys.stderr, flush=True)
    # only SIGINT/SIGTERM stop the mesh: a child that dies is restarted and rejoins
    failed = mesh.supervise(stop)
    mesh.stop()
    if failed:
        print(f"moemesh up: error: {', '.join(failed)} failed for good while the mesh ran", file=sys.stderr)
        return 1
    return 0
