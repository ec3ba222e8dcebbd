"""`python -m attention_svc [flags]`: an attention replica as a process (the same as `moemesh serve attention`)."""
from attention_svc.config import AttentionConfig
from attention_svc.server import run
from moemesh.rpc.server import serve_process
from moemesh.svc_config import parse_config

cfg = parse_config(AttentionConfig, "attention", prog="python -m attention_svc")
serve_process(lambda stop: run(cfg, stop), "python -m attention_svc")
