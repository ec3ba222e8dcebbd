"""Build hook: generate the gRPC stubs from protos/ before packages are collected, so wheels and
container images carry them (editable installs and checkouts also regenerate them on import)."""
import importlib.util
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
spec = importlib.util.spec_from_file_location("moemesh_protos_build", HERE / "moemesh" / "rpc" / "protos.py")
protos = importlib.util.module_from_spec(spec)
spec.loader.exec_module(protos)
protos.ensure_generated(out_dir=HERE / "moemesh" / "_proto", root=HERE / "protos")

setup()
