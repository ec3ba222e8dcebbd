"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5): which cached keys each query attends to.

Shape legend: T tokens, H hidden, Rq q_lora_rank, Hi indexer heads, Di indexer head dim, Dr rope dims
(the first Dr of each indexer head rotate), Q queries, S keys.

  key    k = LayerNorm(wk x) [Di], its first Dr dims rotated; cached per token beside the MLA latent
  query  q = wq_b q_lat [Hi, Di] (q_lat: the MLA's normed q LoRA latent), first Dr dims rotated
  score  I(q, s) = sum_h w_h * relu(q_h . k_s / sqrt(Di)), with w = weights_proj(x) / sqrt(Hi) (float32)
Each query keeps the `index_topk` best-scoring keys among those it may see (causal); MLA then attends
over those keys only. A query that sees at most `index_topk` keys keeps them all, so the selection
only changes anything past `index_topk` positions.

transformers computes the scores in float32 without the reference kernel's Hadamard rotation and FP8
quantisation (a rotation preserves dot products; FP8 is a precision choice); so does this.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.models.deepseek_v3.yarn_rope import apply_rope_interleaved
from moemesh.models.layers import apply_rope, as_tensor

KEY_NORM_EPS = 1e-6  # the indexer's LayerNorm


@dataclass(frozen=True)
class IndexerWeights:
    """wq_b [Hi*Di, Rq], wk [Di, H], k_norm / k_norm_bias [Di] (a LayerNorm), weights_proj [Hi, H]
    (float32, as transformers keeps it); rope_dim Dr; interleaved: the rope layout (GLM-5) or half split."""

    wq_b: Tensor
    wk: Tensor
    k_norm: Tensor
    k_norm_bias: Tensor
    weights_proj: Tensor
    num_heads: int
    head_dim: int
    rope_dim: int
    interleaved: bool


def load_indexer(
    reader: CheckpointReader, prefix: str, hidden: int, q_lora_rank: int, num_heads: int, head_dim: int,
    rope_dim: int, interleaved: bool, dtype: torch.dtype,
) -> IndexerWeights:
    """`prefix` names the indexer module, e.g. model.layers.3.self_attn.indexer. Its weights stay plain
    tensors in any dense_dtype (like a router it scores keys; one read as stored FP8 is dequantized)."""

    def get(name: str, shape: tuple[int, ...], dt: torch.dtype = dtype) -> Tensor:
        return as_tensor(reader.get(f"{prefix}.{name}", shape=shape, dtype=dt), dt)

    return IndexerWeights(
        wq_b=get("wq_b.weight", (num_heads * head_dim, q_lora_rank)),
        wk=get("wk.weight", (head_dim, hidden)),
        k_norm=get("k_norm.weight", (head_dim,)),
        k_norm_bias=get("k_norm.bias", (head_dim,)),
        weights_proj=get("weights_proj.weight", (num_heads, hidden), torch.float32),
        num_heads=num_heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        interleaved=interleaved,
    )


def rotate_prefix(x: Tensor, cos: Tensor, sin: Tensor, w: IndexerWeights) -> Tensor:
    """x [T, N, Di], cos/sin [T, 1, Dr] -> x with its first Dr dims rotated (the rest passes)."""
    dr = w.rope_dim
    rot = apply_rope_interleaved if w.interleaved else apply_rope
    return torch.cat([rot(x[..., :dr], cos, sin), x[..., dr:]], dim=-1)


def index_keys(x: Tensor, w: IndexerWeights, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, H] -> the indexer keys [T, Di] (what the cache holds)."""
    k = F.layer_norm(F.linear(x, w.wk), (w.head_dim,), w.k_norm, w.k_norm_bias, KEY_NORM_EPS)  # [T, Di]
    return rotate_prefix(k[:, None, :], cos, sin, w)[:, 0]


def index_queries(q_lat: Tensor, w: IndexerWeights, cos: Tensor, sin: Tensor) -> Tensor:
    """q_lat [T, Rq] -> [T, Hi, Di]."""
    q = F.linear(q_lat, w.wq_b).view(q_lat.shape[0], w.num_heads, w.head_dim)
    return rotate_prefix(q, cos, sin, w)


def head_weights(x: Tensor, w: IndexerWeights) -> Tensor:
    """x [T, H] -> each head's weight [T, Hi] in float32."""
    return F.linear(x.float(), w.weights_proj) * w.num_heads**-0.5


def index_scores(q: Tensor, hw: Tensor, keys: Tensor, w: IndexerWeights) -> Tensor:
    """q [Q, Hi, Di], hw [Q, Hi], keys [S, Di] (shared by every query) or [Q, S, Di] -> scores [Q, S]
    float32, computed in transformers' order (per-head dot products, scale, relu, weighted head sum)."""
    scores = torch.matmul(q.float(), keys.float().transpose(-1, -2)) * w.head_dim**-0.5  # [Q, Hi, S]
    return torch.matmul(hw[:, None, :], F.relu(scores))[:, 0]  # [Q, S]


def select_top_k(scores: Tensor, visible: Tensor, k: int) -> Tensor:
    """scores [Q, S], visible [Q, S] bool -> [Q, S] bool: each query's k best visible keys (all of its
    visible keys when it has at most k)."""
    masked = scores.masked_fill(~visible, float("-inf"))
    top = masked.topk(min(k, scores.shape[-1]), dim=-1).indices  # [Q, k]
    return torch.zeros_like(visible).scatter_(-1, top, True) & visible
