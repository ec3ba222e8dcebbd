"""`RpcConfig`: the gRPC limits and credentials every server and channel of the mesh shares.

Service configs embed it as a field (`rpc: RpcConfig = RpcConfig()`); `moemesh.svc_config` flattens
its fields into the service's flags (`--max-message-mb`, `--mesh-token-file`, ...) and env overrides.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.security import SecurityConfig

# a channel whose peer went away tries to reconnect after a backoff growing up to this (gRPC's own
# default, 120 s, would leave a service talking to a restarted control plane minutes after it is back)
MAX_RECONNECT_BACKOFF_MS = 2000


@dataclass(frozen=True)
class RpcConfig:
    max_message_mb: int = field(default=256, metadata={"help": "largest gRPC message sent or received, MiB"})
    keepalive_time_s: float = field(default=30.0, metadata={"help": "ping an idle connection this often"})
    keepalive_timeout_s: float = field(default=10.0, metadata={"help": "drop a connection whose ping is unanswered this long"})
    shutdown_grace_s: float = field(default=5.0, metadata={"help": "in-flight calls get this long on shutdown"})
    health_port: int | None = field(default=None, metadata={
        "help": "also serve grpc.health.v1 alone, in plaintext, on this port (kubelet gRPC probes cannot speak TLS); unset = none"})
    security: SecurityConfig = SecurityConfig()

    def __post_init__(self) -> None:
        if not 1 <= self.max_message_mb <= 2047:
            raise ValueError(f"max_message_mb must be in [1, 2047], got {self.max_message_mb}")
        for name in ("keepalive_time_s", "keepalive_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health_port must be in [0, 65535] (or unset), got {self.health_port}")
        if self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")

    @property
    def max_message_bytes(self) -> int:
        return self.max_message_mb * 1024 * 1024

    def channel_options(self) -> list[tuple[str, int]]:
        """Options shared by servers and channels: message limits and keepalive (a channel adds
        `security.channel_options()`)."""
        return [
            ("grpc.max_send_message_length", self.max_message_bytes),
            ("grpc.max_receive_message_length", self.max_message_bytes),
            ("grpc.keepalive_time_ms", int(self.keepalive_time_s * 1000)),
            ("grpc.keepalive_timeout_ms", int(self.keepalive_timeout_s * 1000)),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.max_pings_without_data", 0),
            ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ]

    def server_options(self) -> list[tuple[str, int]]:
        # Accept client pings as often as our own clients send them.
        return self.channel_options() + [
            ("grpc.http2.min_ping_interval_without_data_ms", int(self.keepalive_time_s * 1000) // 2),
            ("grpc.so_reuseport", 0),
        ]
