"""`moemesh serve router|attention|expert|control|gateway [flags]`: run one service of the mesh.

Each service's flags (and `MOEMESH_<SERVICE>_*` env overrides) derive from its frozen config
dataclass through `moemesh.svc_config`. Every service is put together the same way: `x_svc.config`
holds its config class, `x_svc.server.run(cfg, stop)` serves until `stop` is set (SIGTERM/SIGINT),
then drains; it prints `moemesh x_svc: serving HOST:PORT` once up (as `python -m x_svc` does).
"""
from __future__ import annotations

import argparse
import importlib
import sys

# service -> (config class, `async run(cfg, stop)`), as "module:attribute"
SERVICES = {
    "router": ("router_svc.config:RouterConfig", "router_svc.server:run"),
    "attention": ("attention_svc.config:AttentionConfig", "attention_svc.server:run"),
    "expert": ("expert_svc.config:ExpertServerConfig", "expert_svc.server:run"),
    "control": ("control_svc.config:ControlConfig", "control_svc.server:run"),
    "gateway": ("gateway_svc.config:GatewayConfig", "gateway_svc.server:run"),
}


def resolve(spec: str):
    module, _, attr = spec.partition(":")
    return getattr(importlib.import_module(module), attr)


def register(subparsers) -> None:
    from moemesh.svc_config import add_arguments

    p = subparsers.add_parser("serve", help="run one service of the mesh (router, attention, expert, control, gateway)")
    services = p.add_subparsers(dest="service", required=True, metavar="SERVICE")
    for name, (config_spec, run_spec) in SERVICES.items():
        try:
            cls = resolve(config_spec)
        except (ImportError, AttributeError) as e:
            sp = services.add_parser(name, help=f"(unavailable: {e})")
            sp.set_defaults(func=lambda ns, n=name, err=e: unavailable(n, err))
            continue
        doc = (cls.__doc__ or "").strip().splitlines()
        sp = services.add_parser(name, help=doc[0] if doc else f"the {name} service")
        add_arguments(sp, cls, name)
        sp.set_defaults(func=lambda ns, n=name, c=cls, s=run_spec: run(ns, n, c, s))


def unavailable(name: str, err: Exception) -> int:
    print(f"moemesh serve {name}: error: this service cannot be loaded ({err})", file=sys.stderr)
    return 2


def run(ns: argparse.Namespace, name: str, cls, run_spec: str) -> int:
    """Serves until SIGTERM/SIGINT, drains, then ends the process (serve_process: a service that cannot
    start prints one line and exits 2, one that fails exits 1)."""
    from moemesh.rpc.server import serve_process
    from moemesh.svc_config import from_sources

    fields = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in ("command", "service", "func")})
    cfg = from_sources(cls, name, fields)  # a bad flag: one line naming it from moemesh.cli.main, status 2
    runner = resolve(run_spec)
    serve_process(lambda stop: runner(cfg, stop), f"moemesh serve {name}")
