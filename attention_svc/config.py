"""`AttentionConfig`: every setting of an attention replica (flags and env overrides derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.config import EngineConfig
from moemesh.rpc.config import RpcConfig


@dataclass(frozen=True)
class AttentionConfig:
    """An attention replica: the model's non-expert half, with experts on the mesh's expert servers."""

    engine: EngineConfig = field(metadata={
        # top-k and capacity are the control plane's knobs (`moemesh ctl set`), not flags of a replica
        "omit": ("moe_top_k", "capacity_factor"),
        # a replica process takes torch's thread count unless told (the launcher and manifests set it)
        "defaults": {"num_threads": None},
    })
    control_addr: str = field(default="", metadata={"help": "control plane HOST:PORT (empty = compute experts in this process)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "port to bind (0 = any free port)"})
    transport: str = field(default="grpc", metadata={"help": "expert transport (auto: torch.distributed with experts on this node, gRPC otherwise)", "choices": ("grpc", "dist", "auto")})
    failover_timeout_s: float = field(default=30.0, metadata={"help": "a MoE layer whose expert server died waits this long for a placement without it, then its requests fail UNAVAILABLE"})
    metrics_port: int | None = field(default=None, metadata={"help": "Prometheus /metrics port (step time, batch size); unset = none, 0 = any free port"})
    rpc: RpcConfig = field(default_factory=RpcConfig)

    def __post_init__(self) -> None:
        self.rpc.security.require_token()  # a service never serves open by accident
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (or unset), got {self.metrics_port}")
        if self.failover_timeout_s <= 0:
            raise ValueError(f"failover_timeout_s must be > 0, got {self.failover_timeout_s}")
