"""`ExpertServerConfig`: everything an expert server is started with (flags and env derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from kernels.prepare import EXPERT_DTYPES
from moemesh.rpc.config import RpcConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
TRANSPORTS = ("grpc", "dist", "auto")
PRELOAD = ("none", "all")


@dataclass(frozen=True)
class ExpertServerConfig:
    """An expert server: (layer, expert) shards of one model on one device."""

    model_dir: str = field(metadata={"help": "Hugging Face model directory (safetensors are memory-mapped)"})
    device: str = field(default="cpu", metadata={"help": "cpu or cuda:N"})
    dtype: str = field(default="auto", metadata={"help": "compute dtype; auto = the checkpoint's", "choices": DTYPES})
    experts_dtype: str | None = field(default=None, metadata={"help": "expert weight format", "choices": EXPERT_DTYPES})
    host: str = field(default="127.0.0.1", metadata={"help": "interface to bind"})
    port: int = field(default=0, metadata={"help": "gRPC port; 0 picks a free one"})
    advertise_addr: str | None = field(default=None, metadata={"help": "host:port others dial; default host:bound port"})
    control_addr: str | None = field(default=None, metadata={"help": "control plane host:port; none = standalone"})
    slot_budget: int = field(default=0, metadata={"help": "most (layer, expert) copies to hold; 0 = no limit"})
    memory_bytes: int = field(default=0, metadata={"help": "memory offered for experts, reported to the control plane; 0 = unknown"})
    preload: str = field(default="none", metadata={"help": "experts to load at start: none (wait for the control plane) or all", "choices": PRELOAD})
    transport: str = field(default="auto", metadata={"help": "offer the torch.distributed transport (dist|auto) or gRPC only", "choices": TRANSPORTS})
    dist_port: int = field(default=0, metadata={"help": "TCPStore port of the dist transport; 0 picks a free one"})
    dist_timeout_s: float = field(default=60.0, metadata={"help": "forming a dist pair group or one transfer may take this long"})
    drain_timeout_s: float = field(default=30.0, metadata={"help": "on SIGTERM, in-flight work gets this long"})
    compute_threads: int = field(default=1, metadata={"help": "expert calls computed concurrently"})
    inline_max_elements: int = field(default=1 << 18, metadata={
        "help": "with compute_threads 1, a gRPC call whose rows x hidden is at most this (decode-sized) "
                "is computed on the event loop, saving two thread hand-offs; 0 = always on the compute pool"})
    all_experts_path: bool = field(default=True, metadata={
        "help": "for a model whose top-k is its number of experts, calls that send every token to every expert held "
                "run those experts side by side as two matmuls (moe.layer_experts); off, every call runs kernels.moe_mlp"})
    num_threads: int = field(default=0, metadata={"help": "torch intra-op threads for the expert GEMMs (0 = torch's default: every core)"})
    load_cpu_share: float = field(default=0.1, metadata={
        "help": "while the server serves calls, loading and dropping experts use at most this share of its CPUs "
                "(its CPU budget), pausing between layers, so a switch does not starve the calls; 1 = no pauses"})
    load_window_s: float = field(default=60.0, metadata={"help": "sliding window of the per-expert token counts reported to the control plane"})
    metrics_port: int | None = field(default=None, metadata={"help": "Prometheus /metrics port; unset = no metrics endpoint, 0 = any free port"})
    rpc: RpcConfig = RpcConfig()

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir must name a model directory")
        self.rpc.security.require_token()  # a service never serves open by accident
        if not (self.device == "cpu" or (self.device.startswith("cuda:") and self.device[5:].isdigit())):
            raise ValueError(f"device must be cpu or cuda:N, got {self.device!r}")
        if not 0.0 < self.load_cpu_share <= 1.0:
            raise ValueError(f"load_cpu_share must be in (0, 1], got {self.load_cpu_share!r}")
        for name in ("port", "dist_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} must be in [0, 65535], got {getattr(self, name)}")
        for name in ("slot_budget", "memory_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (or unset), got {self.metrics_port}")
        for name in ("drain_timeout_s", "dist_timeout_s", "load_window_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        if self.compute_threads < 1:
            raise ValueError(f"compute_threads must be >= 1, got {self.compute_threads}")
        if self.inline_max_elements < 0:
            raise ValueError(f"inline_max_elements must be >= 0, got {self.inline_max_elements}")
        if self.advertise_addr is not None and ":" not in self.advertise_addr:
            raise ValueError(f"advertise_addr must be host:port, got {self.advertise_addr!r}")
        for name in ("dtype", "experts_dtype", "transport", "preload"):
            choices = {"dtype": DTYPES, "experts_dtype": EXPERT_DTYPES + (None,), "transport": TRANSPORTS, "preload": PRELOAD}[name]
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {[c for c in choices if c]}, got {getattr(self, name)!r}")

    @property
    def offers_dist(self) -> bool:
        return self.transport in ("dist", "auto")
