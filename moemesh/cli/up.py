"""`moemesh up`: the whole mesh on this machine, as separate processes, until SIGINT/SIGTERM.
A child that dies is restarted (with backoff) and rejoins; one that keeps dying is reported failed
and the rest keep serving (exit 1 at the end)."""
from __future__ import annotations

import argparse
import signal
import sys
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

from moemesh.launcher.mesh import MeshSpec

# the mesh's public doors: `up` serves them, `demo` and `bench` start a mesh for one run without them
PUBLIC_DOORS = ("port", "http_port", "api_key", "tls_cert", "tls_key", "tls_ca", "tls_server_name")


def mesh_field(omit: tuple[str, ...] = ()):
    """A command's `MeshSpec`: each field a flag under its own name (`--model` and `--start-timeout`
    for model_dir and start_timeout_s), no --model meaning the demo model; `omit` gets no flag."""
    return field(metadata={"omit": ("host", "grace_s", *omit), "defaults": {"model_dir": ""},
                           "flags": {"model_dir": "--model", "start_timeout_s": "--start-timeout"}})


def log_dir_field():
    return field(default=None, metadata={"help": "where the services' logs and the mesh token go; unset = a new temporary directory",
                                         "metavar": "DIR"})


@dataclass(frozen=True)
class UpConfig:
    """`moemesh up`'s flags: the mesh, and where its logs go."""

    mesh: MeshSpec = mesh_field()
    log_dir: str | None = log_dir_field()


@dataclass(frozen=True)
class RunMeshConfig:
    """The mesh flags of `moemesh demo` and `moemesh bench`: a mesh for one run, without public doors."""

    mesh: MeshSpec = mesh_field(PUBLIC_DOORS)
    log_dir: str | None = log_dir_field()


def add_mesh_arguments(p: argparse.ArgumentParser, cls: type = RunMeshConfig) -> None:
    """The flags of `cls` (UpConfig or RunMeshConfig), derived from its fields."""
    from moemesh.svc_config import add_arguments

    add_arguments(p, cls, None)


def mesh_config(ns: argparse.Namespace, cls: type = RunMeshConfig, progress: Callable[[str], None] | None = None):
    """The parsed flags as `cls`, the demo model (built if absent) standing in for an empty --model.
    Raises ValueError naming the flag on a bad value (one line from moemesh.cli.main, status 2)."""
    from moemesh.cli.checks import check_at_least, check_model_dir, check_timeout
    from moemesh.svc_config import from_sources

    cfg = from_sources(cls, None, ns)
    check_at_least("--attention-threads", cfg.mesh.attention_threads, 0)
    check_timeout("--start-timeout", cfg.mesh.start_timeout_s)
    if cfg.mesh.model_dir:
        check_model_dir("--model", cfg.mesh.model_dir)
        return cfg
    from moemesh.demo_model import ensure_demo_model

    model = ensure_demo_model(progress=progress) if progress is not None else ensure_demo_model()
    return replace(cfg, mesh=replace(cfg.mesh, model_dir=str(model)))


def register(subparsers) -> None:
    p = subparsers.add_parser("up", help="start the whole mesh on this machine (control, experts, attention, router)")
    add_mesh_arguments(p, UpConfig)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    from moemesh.launcher.mesh import Mesh, MeshFailed

    # a bad flag: one line naming it from moemesh.cli.main, status 2
    cfg = mesh_config(ns, UpConfig)
    mesh = Mesh(cfg.mesh, cfg.log_dir)
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
