"""`python -m router_svc [flags]`: the router as a process (the same as `moemesh serve router`)."""
from moemesh.rpc.server import serve_process
from moemesh.svc_config import parse_config
from router_svc.config import RouterConfig
from router_svc.server import run

cfg = parse_config(RouterConfig, "router", prog="python -m router_svc")
serve_process(lambda stop: run(cfg, stop), "python -m router_svc")
