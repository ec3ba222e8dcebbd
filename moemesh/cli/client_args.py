"""The credentials `moemesh generate` and `moemesh ctl` call a mesh with.

The flags derive from the fields through `moemesh.svc_config` (as the services' do): the mesh token
(`--mesh-token-file` or `MOEMESH_MESH_TOKEN`: the control plane requires it), mTLS (`--tls-cert`,
`--tls-key`, `--tls-ca`, `--tls-server-name`) and, for the router, its API key (`--api-key` or
`MOEMESH_API_KEY`).
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.security import SecurityConfig
from moemesh.svc_config import add_arguments, field_specs, from_sources

# a client sends what it has; refusing to run without a token is the servers' business
CLIENT_SECURITY = {"omit": ("insecure_no_auth",)}


@dataclass(frozen=True)
class ControlClientArgs:
    """`moemesh ctl`: the control plane is internal (mesh token, mTLS)."""

    security: SecurityConfig = field(default=SecurityConfig(), metadata=CLIENT_SECURITY)

    def rpc(self) -> RpcConfig:
        return RpcConfig(security=self.security)


@dataclass(frozen=True)
class RouterClientArgs:
    """`moemesh generate`: the router's public API (its API key, mTLS when the router has it)."""

    security: SecurityConfig = field(default=SecurityConfig(), metadata=CLIENT_SECURITY)
    api_key: str = field(default="", repr=False, metadata={
        "env": "MOEMESH_API_KEY", "metavar": "KEY", "help": "the router's API key, sent as `authorization: Bearer KEY`"})

    def rpc(self) -> RpcConfig:
        return RpcConfig(security=self.security)


def add_client_arguments(p: argparse.ArgumentParser, cls: type) -> None:
    add_arguments(p, cls, None)


def client_args(cls: type, ns: argparse.Namespace):
    """`cls` from a parsed command line (ValueError naming the flag when a value is unusable)."""
    names = {s.name for s in field_specs(cls)}
    return from_sources(cls, None, argparse.Namespace(**{k: v for k, v in vars(ns).items() if k in names}))
