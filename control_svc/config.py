"""`ControlConfig`: the control plane's settings (flags and env derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.config import RpcConfig


@dataclass(frozen=True)
class ControlConfig:
    """The control plane: registry of expert servers and attention replicas, versioned placement."""

    model_dir: str = field(metadata={"help": "model directory (its config.json says which layers have how many experts)"})
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0 picks a free one"})
    expected_expert_servers: int = field(default=1, metadata={"help": "place experts once this many servers registered"})
    heartbeat_interval_s: float = field(default=1.0, metadata={"help": "how often servers and replicas heartbeat"})
    dead_after_s: float = field(default=5.0, metadata={"help": "a server silent this long is marked dead"})
    prepare_timeout_s: float = field(default=120.0, metadata={"help": "expert servers get this long to load new experts"})
    release_timeout_s: float = field(default=30.0, metadata={"help": "old copies are dropped once replicas adopted the new version, or after this long"})
    rpc: RpcConfig = RpcConfig()

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name a model directory")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.expected_expert_servers < 1:
            raise ValueError(f"expected_expert_servers must be >= 1, got {self.expected_expert_servers}")
        for name in ("heartbeat_interval_s", "dead_after_s", "prepare_timeout_s", "release_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError(f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_interval_s ({self.heartbeat_interval_s})")
