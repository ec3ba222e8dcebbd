"""`AttentionConfig`: every setting of an attention replica (flags and env overrides derive from it)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.rpc.config import RpcConfig


@dataclass(frozen=True)
class AttentionConfig:
    """An attention replica: the model's non-expert half, with experts on the mesh's expert servers."""

    model_dir: str = field(default="", metadata={"help": "Hugging Face model directory"})
    control_addr: str = field(default="", metadata={"help": "control plane HOST:PORT (empty = compute experts in this process)"})
    host: str = field(default="127.0.0.1", metadata={"help": "address to bind"})
    port: int = field(default=0, metadata={"help": "port to bind (0 = any free port)"})
    transport: str = field(default="grpc", metadata={"help": "expert transport (auto: torch.distributed with experts on this node, gRPC otherwise)", "choices": ("grpc", "dist", "auto")})
    dtype: str = field(default="auto", metadata={"help": "compute dtype", "choices": ("auto", "float32", "bfloat16")})
    device: str = field(default="cpu", metadata={"help": "where weights, KV cache and steps live: cpu, cuda or cuda:N"})
    experts_dtype: str = field(default="", metadata={"help": "expert weight format when computed in process (empty = as stored)"})
    block_size: int = field(default=16, metadata={"help": "tokens per KV cache block"})
    kv_cache_tokens: int = field(default=8192, metadata={"help": "KV cache capacity in tokens"})
    max_num_seqs: int = field(default=64, metadata={"help": "sequences per step"})
    max_num_batched_tokens: int = field(default=4096, metadata={"help": "tokens per step"})
    max_model_len: int = field(default=0, metadata={"help": "context length (0 = the model's)"})
    micro_batches: int = field(default=1, metadata={"help": "1, or 2 to overlap attention with the experts (ping-pong; pays when expert servers have cores of their own)"})
    num_threads: int = field(default=0, metadata={"help": "torch intra-op threads (0 = torch's default)"})
    failover_timeout_s: float = field(default=30.0, metadata={"help": "a MoE layer whose expert server died waits this long for a placement without it, then its requests fail UNAVAILABLE"})
    metrics_port: int | None = field(default=None, metadata={"help": "Prometheus /metrics port (step time, batch size); unset = none, 0 = any free port"})
    rpc: RpcConfig = field(default_factory=RpcConfig)

    def __post_init__(self) -> None:
        if not self.model_dir:
            raise ValueError("model_dir is required (--model-dir DIR)")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.metrics_port is not None and not 0 <= self.metrics_port <= 65535:
            raise ValueError(f"metrics_port must be in [0, 65535] (or unset), got {self.metrics_port}")
        if self.failover_timeout_s <= 0:
            raise ValueError(f"failover_timeout_s must be > 0, got {self.failover_timeout_s}")
        from moemesh.engine.device import device_format_error

        if device_format_error(self.device):
            raise ValueError(device_format_error(self.device))
        if self.max_model_len < 0 or self.num_threads < 0:
            raise ValueError("max_model_len and num_threads must be >= 0")

    def engine_config(self):
        from moemesh.engine import EngineConfig

        return EngineConfig(
            model_dir=self.model_dir,
            dtype=self.dtype,
            experts_dtype=self.experts_dtype or None,
            block_size=self.block_size,
            kv_cache_tokens=self.kv_cache_tokens,
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens,
            max_model_len=self.max_model_len or None,
            micro_batches=self.micro_batches,
            num_threads=self.num_threads or None,
            device=self.device,
        )
