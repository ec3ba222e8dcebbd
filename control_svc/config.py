"""`ControlConfig`: the control plane's settings (flags and env derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from control_svc.placement import RebalancePolicy
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
    rebalance_interval_s: float = field(default=0.0, metadata={"help": "check the expert load this often and rebalance when worth it; 0 = only on request (moemesh ctl rebalance)"})
    rebalance_min_gain: float = field(default=0.05, metadata={
        "help": "how much faster the cost model must predict a step to become for a rebalance (0.05 = 5%%) unless forced"})
    rebalance_payback_s: float = field(default=60.0, metadata={
        "help": "a rebalance's loading time must be won back by its faster steps within this many seconds of serving"})
    rebalance_min_tokens: int = field(default=1000, metadata={"help": "fewer tokens in the servers' load windows than this: no periodic rebalance"})
    rebalance_max_moves: int = field(default=0, metadata={"help": "most expert copies a periodic rebalance may load; 0 = no limit"})
    rebalance_tolerance: float = field(default=0.05, metadata={"help": "relative balance the solver trades for fewer moves"})
    redundant_experts: int | None = field(default=None, metadata={
        "help": "extra expert copies per MoE layer a rebalance may place (replicas of the hottest); the cost model compares "
                "them with none; unset = every free slot"})
    recovery_wait_s: float = field(default=10.0, metadata={
        "help": "after a restart, the placement is rebuilt from what the expert servers hold once expected_expert_servers re-registered, "
                "or this long after the first did"})
    failure_probe_timeout_s: float = field(default=1.0, metadata={"help": "a server reported unreachable is declared dead when it does not answer within this"})
    max_expert_tokens_per_s: float = field(default=1e6, metadata={
        "help": "a heartbeat's token count per (layer, expert) is clamped to this rate over its load window (no forged load swamps the placement)"})
    metrics_port: int | None = field(default=None, metadata={"help": "Prometheus /metrics port; unset = no metrics endpoint, 0 = any free port"})
    rpc: RpcConfig = RpcConfig()

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name a model directory")
        self.rpc.security.require_token()  # a service never serves open by accident
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.expected_expert_servers < 1:
            raise ValueError(f"expected_expert_servers must be >= 1, got {self.expected_expert_servers}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (or unset), got {self.metrics_port}")
        if self.rebalance_interval_s < 0:
            raise ValueError(f"rebalance_interval_s must be >= 0, got {self.rebalance_interval_s}")
        if self.redundant_experts is not None and self.redundant_experts < 0:
            raise ValueError(f"redundant_experts must be >= 0 (or unset), got {self.redundant_experts}")
        for name in ("heartbeat_interval_s", "dead_after_s", "prepare_timeout_s", "release_timeout_s", "failure_probe_timeout_s",
                     "max_expert_tokens_per_s", "recovery_wait_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        self.policy()  # validates the rebalance_* fields
        if self.dead_after_s <= self.heartbeat_interval_s:
            raise ValueError(f"dead_after_s ({self.dead_after_s}) must exceed heartbeat_interval_s ({self.heartbeat_interval_s})")

    def policy(self) -> RebalancePolicy:
        return RebalancePolicy(
            min_gain=self.rebalance_min_gain, payback_s=self.rebalance_payback_s, min_tokens=self.rebalance_min_tokens,
            max_moves=self.rebalance_max_moves, tolerance=self.rebalance_tolerance,
        )
