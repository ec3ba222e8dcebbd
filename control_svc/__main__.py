"""`python -m control_svc [flags]`: the control plane as a process (the same as `moemesh serve control`)."""
from control_svc.config import ControlConfig
from control_svc.server import run
from moemesh.rpc.server import serve_process
from moemesh.svc_config import parse_config

cfg = parse_config(ControlConfig, "control", prog="python -m control_svc")
serve_process(lambda stop: run(cfg, stop), "python -m control_svc")
