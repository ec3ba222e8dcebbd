"""`python -m gateway_svc --router HOST:PORT [...]`: the HTTP gateway on its own."""
import logging
import sys

from gateway_svc.config import GatewayConfig
from gateway_svc.server import serve
from moemesh.svc_config import parse_config

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
serve(parse_config(GatewayConfig, "gateway", prog="python -m gateway_svc"))
