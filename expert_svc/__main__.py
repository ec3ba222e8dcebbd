"""`python -m expert_svc [flags]`: an expert server as a process (the same as `moemesh serve expert`)."""
from expert_svc.config import ExpertServerConfig
from expert_svc.server import run
from moemesh.rpc.server import serve_process
from moemesh.svc_config import parse_config

cfg = parse_config(ExpertServerConfig, "expert", prog="python -m expert_svc")
serve_process(lambda stop: run(cfg, stop), "python -m expert_svc")
