"""`RouterConfig`: every setting of the router service (flags and env overrides derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.config import RpcConfig
from moemesh.rpc.security import check_secret


@dataclass(frozen=True)
class RouterConfig:
    """The router: the public Generation API in front of the attention replicas."""

    attention: str = field(default="", metadata={"help": "comma-separated HOST:PORT of the attention replicas; a name stands for every address it resolves to (e.g. a headless Service)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "port to bind (0 = any free port)"})
    model_dir: str = field(default="", metadata={"help": "model directory for the tokenizer (default: the one the replicas report)"})
    model_name: str = field(default="", metadata={"help": "name clients may pass as `model` (default: the model directory's name)"})
    max_running: int = field(default=256, metadata={"help": "streams served at once"})
    max_queued: int = field(default=256, metadata={"help": "streams waiting for a slot; beyond it RESOURCE_EXHAUSTED"})
    load_poll_s: float = field(default=0.2, metadata={"help": "how often to ask each replica for its load"})
    discovery_interval_s: float = field(default=10.0, metadata={"help": "how often to re-resolve the attention names (new pods join, vanished ones drain); 0 = only at start"})
    connect_timeout_s: float = field(default=60.0, metadata={"help": "how long to wait for the replicas at start"})
    prefix_routing: bool = field(default=True, metadata={"help": "send a request to the replica that most likely holds its prompt's prefix in its prefix cache (else the least loaded)"})
    prefix_imbalance: int = field(default=16, metadata={"help": "prefix-aware routing gives way to the least loaded replica when the prefix holder runs more than this many sequences above it"})
    metrics_port: int | None = field(default=None, metadata={"help": "Prometheus /metrics port (queue depth); unset = none, 0 = any free port"})
    api_key: str = field(default="", repr=False, metadata={
        "env": "MOEMESH_API_KEY", "metavar": "KEY",
        "help": "when set, every call of the public API needs `authorization: Bearer KEY` (health checks excepted)"})
    rpc: RpcConfig = field(default_factory=RpcConfig)

    def __post_init__(self) -> None:
        self.rpc.security.require_token()  # a service never serves open by accident
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be >= 1, got {self.max_running}")
        if self.max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {self.max_queued}")
        if self.load_poll_s <= 0:
            raise ValueError(f"load_poll_s must be > 0, got {self.load_poll_s}")
        if self.prefix_imbalance < 0:
            raise ValueError(f"prefix_imbalance must be >= 0, got {self.prefix_imbalance}")
        if self.api_key:
            check_secret("api_key", self.api_key)
        if self.discovery_interval_s < 0:
            raise ValueError(f"discovery_interval_s must be >= 0, got {self.discovery_interval_s}")

    @property
    def attention_addresses(self) -> list[str]:
        return [a.strip() for a in self.attention.split(",") if a.strip()]
