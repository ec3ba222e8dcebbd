"""Bytes a decode step must read, and the memory copy bandwidth that bounds how fast it can read them.

A decode step at batch B (B sequences, one new token each) reads every non-expert weight once
(attention, routers, norms, dense MLP layers, the LM head; of the embedding only B rows, left out)
and, in each MoE layer, the weights of every expert that at least one of the B tokens is routed to,
in the format the experts are served in. With top-k of E experts and routing spread evenly, an
expert escapes all B tokens with probability (1 - k/E)^B, so a layer reads on average
E * (1 - (1 - k/E)^B) experts: k at batch 1, nearly all E at large batches, all E when k == E.
The KV cache reads are left out (a few MB at benchmark context lengths).

achieved GB/s = bytes per step / wall seconds per step, next to the copy bandwidth (bytes read +
written per second by a large `copy_`): a decode step that reads each weight once from memory
cannot go much past it.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from moemesh.config import ModelConfig


def expected_distinct_experts(num_experts: int, top_k: int, batch: int) -> float:
    """Experts of a layer that at least one of `batch` tokens is routed to, on average (even routing)."""
    if not 1 <= top_k <= num_experts or batch < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts and batch >= 0, got top_k={top_k}, num_experts={num_experts}, batch={batch}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class StepBytes:
    """Weight bytes one decode step reads, by kind."""

    batch: int
    distinct_experts: float  # per MoE layer
    num_experts: int
    experts: float
    attention: int
    lm_head: int
    other: int  # routers, norms, dense MLP layers

    @property
    def total(self) -> float:
        return self.experts + self.attention + self.lm_head + self.other

    def describe(self) -> str:
        return (
            f"{mb(self.total)}/step: experts {mb(self.experts)} ({self.distinct_experts:.1f} of {self.num_experts} per layer), "
            f"attention {mb(self.attention)}, LM head {mb(self.lm_head)}, other {mb(self.other)}"
        )


def mb(n: float) -> str:
    """Bytes in GB, MB or kB, whichever reads best."""
    if n >= 1e9:
        return f"{n / 1e9:.2f} GB"
    return f"{n / 1e6:.1f} MB" if n >= 1e6 else f"{n / 1e3:.1f} kB"


def expert_bytes(model_dir: str | Path, dtype: torch.dtype, experts_dtype: str | None) -> int:
    """Bytes of one expert (gate, up, down with their scales) as an engine computing in `dtype` with
    `--experts-dtype experts_dtype` holds it: expert 0 of the first MoE layer, loaded the engine's way."""
    from moemesh.checkpoint import CheckpointReader
    from moemesh.moe.expert_loader import load_expert_weights

    from moemesh.models.registry import load_model_config

    cfg = load_model_config(model_dir)
    if not cfg.moe_layers:
        raise ValueError(f"{model_dir} has no MoE layer")
    w = load_expert_weights(CheckpointReader(model_dir), cfg, cfg.moe_layers[0], [0], dtype, experts_dtype)
    return w.nbytes


def step_bytes(
    cfg: ModelConfig, dtype: torch.dtype, one_expert_bytes: int, batch: int, top_k: int | None = None,
    dense_dtype: str | None = None,
) -> StepBytes:
    """The weight bytes of a decode step at `batch`, non-expert weights held in `dtype`; with dense_dtype
    "fp8" (`EngineConfig.dense_dtype`) the attention projections, dense MLPs and LM head in BlockwiseFP8
    (a byte per element and a float32 scale per 128 x 128 block)."""
    size = dtype.itemsize

    def matrix(n: int, k: int) -> int:  # one dense linear's weight [n, k] as held
        if dense_dtype == "fp8":
            return n * k + 4 * -(-n // 128) * -(-k // 128)
        return n * k * size

    h, d, nh, kvh = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads
    attention = cfg.num_layers * (matrix((nh + 2 * kvh) * d, h) + matrix(h, nh * d))
    moe = cfg.moe_layers
    dense_layers = cfg.num_layers - len(moe)
    norms = (2 * cfg.num_layers + 1) * h + (2 * d * cfg.num_layers if cfg.qk_norm else 0)
    other = (len(moe) * cfg.num_experts * h + norms) * size
    other += dense_layers * (matrix(2 * cfg.intermediate_size, h) + matrix(h, cfg.intermediate_size))
    distinct = expected_distinct_experts(cfg.num_experts, top_k or cfg.top_k, batch) if moe else 0.0
    return StepBytes(
        batch=batch, distinct_experts=distinct, num_experts=cfg.num_experts, experts=len(moe) * distinct * one_expert_bytes,
        attention=attention, lm_head=matrix(cfg.vocab_size, h), other=other,
    )


def copy_bandwidth_gbs() -> float:
    """Best-of-5 memory copy bandwidth (bytes read + written per second) on a 256 MB buffer."""
    src = torch.empty(64 * 1024 * 1024, dtype=torch.float32).uniform_()
    dst = torch.empty_like(src)
    fastest = float("inf")
    for _ in range(6):
        start = time.perf_counter()
        dst.copy_(src)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * src.numel() * 4 / fastest / 1e9


def bandwidth(traffic: StepBytes, step_s: float, limit_gbs: float) -> str:
    """'X GB/s = Y% of the copy bandwidth' for a step of `step_s` wall seconds."""
    gbs = traffic.total / max(step_s, 1e-12) / 1e9
    return f"{gbs:.1f} GB/s = {gbs / limit_gbs:.0%} of the copy bandwidth ({limit_gbs:.1f} GB/s)"
