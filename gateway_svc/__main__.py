"""`python -m gateway_svc [flags]`: the HTTP gateway as a process (the same as `moemesh serve gateway`)."""
from gateway_svc.config import GatewayConfig
from gateway_svc.server import run
from moemesh.rpc.server import serve_process
from moemesh.svc_config import parse_config

cfg = parse_config(GatewayConfig, "gateway", prog="python -m gateway_svc")
serve_process(lambda stop: run(cfg, stop))
