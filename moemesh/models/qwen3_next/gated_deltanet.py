"""Gated DeltaNet, the linear-attention layer of Qwen3-Next / Qwen3.5, over a batch of sequences with
their recurrent state (moemesh/models/recurrent_state.py).

Shape legend: T tokens, H hidden, Hk key heads, Hv value heads, Dk / Dv head dims, Kd = Hk*Dk,
Vd = Hv*Dv, C = 2Kd + Vd conv channels, K conv kernel, B decoding sequences, n chunk length.

  in_proj   x -> q, k, v (the conv's channels), z (output gate), b, a         [2Kd+Vd | Vd | Hv | Hv]
  conv      causal depthwise conv + SiLU over q, k, v (causal_conv.py; state: last K-1 inputs)
  mixer     gated delta rule (delta_rule.py) with beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias)
  out       RMSNorm(o) * silu(z) per value head (norms.py), then out_proj
Decodes run one recurrent step each, batched; each chunk (a prompt, or a part of one in chunked
prefill) runs the chunked form from its sequence's state: zero for a chunk at position 0, else what
the sequence's previous chunk or step left in its slot. On disk Qwen3-Next groups q/k/v/z and b/a per key head (in_proj_qkvz, in_proj_ba);
Qwen3.5 stores them flat (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a). Both load into one layout.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moemesh.checkpoint import CheckpointReader
from moemesh.models.batch import BatchMeta
from moemesh.models.layers import linear, matmul_layout
from moemesh.models.qwen3_next.causal_conv import conv_prefill, conv_step
from moemesh.models.qwen3_next.config import HybridConfig
from moemesh.models.qwen3_next.delta_rule import chunked, recurrent_step
from moemesh.models.qwen3_next.norms import gated_rms_norm
from moemesh.models.recurrent_state import LayerState


@dataclass(frozen=True)
class DeltaNetWeights:
    """in_proj [C+Vd+2Hv, H] (q, k, v, z, b, a rows), conv [C, K], dt_bias [Hv], decay_rate [Hv] float32
    (= exp(A_log)), norm [Dv], out [H, Vd]."""

    in_proj: Tensor
    conv: Tensor
    dt_bias: Tensor
    decay_rate: Tensor
    norm: Tensor
    out: Tensor
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    norm_eps: float


def load_deltanet(
    reader: CheckpointReader, prefix: str, hc: HybridConfig, hidden: int, eps: float, dtype: torch.dtype,
    dense_dtype: str | None = None,
) -> DeltaNetWeights:
    """dense_dtype: in_proj and out held in it (`matmul_layout`)."""
    hk, hv, dk, dv = hc.linear_num_key_heads, hc.linear_num_value_heads, hc.linear_key_head_dim, hc.linear_value_head_dim
    kd, vd, r = hk * dk, hv * dv, hv // hk

    def get(name: str, shape: tuple[int, ...]) -> Tensor:
        return reader.get(f"{prefix}.{name}", shape=shape, dtype=dtype)

    if reader.has(f"{prefix}.in_proj_qkvz.weight"):  # Qwen3-Next: grouped per key head
        qkvz = get("in_proj_qkvz.weight", (2 * kd + 2 * vd, hidden)).view(hk, 2 * dk + 2 * r * dv, hidden)
        ba = get("in_proj_ba.weight", (2 * hv, hidden)).view(hk, 2 * r, hidden)
        splits = (dk, dk, r * dv, r * dv)
        q, k, v, z = (part.reshape(-1, hidden) for part in qkvz.split(splits, dim=1))
        b, a = (part.reshape(hv, hidden) for part in ba.split((r, r), dim=1))
        rows = [q, k, v, z, b, a]
    else:  # Qwen3.5: flat
        rows = [get("in_proj_qkv.weight", (2 * kd + vd, hidden)), get("in_proj_z.weight", (vd, hidden)),
                get("in_proj_b.weight", (hv, hidden)), get("in_proj_a.weight", (hv, hidden))]
    return DeltaNetWeights(
        in_proj=matmul_layout(torch.cat(rows), dense_dtype=dense_dtype),
        conv=get("conv1d.weight", (hc.conv_dim, 1, hc.conv_kernel))[:, 0].contiguous(),
        dt_bias=get("dt_bias", (hv,)),
        decay_rate=get("A_log", (hv,)).float().exp(),  # A_log in the compute dtype first, as transformers holds it
        norm=get("norm.weight", (dv,)),
        out=matmul_layout(get("out_proj.weight", (hidden, vd)), dense_dtype=dense_dtype),
        num_key_heads=hk,
        num_value_heads=hv,
        key_head_dim=dk,
        value_head_dim=dv,
        norm_eps=eps,
    )


def split_qkv(mixed: Tensor, w: DeltaNetWeights) -> tuple[Tensor, Tensor, Tensor]:
    """mixed [..., C] -> q, k [..., Hk, Dk], v [..., Hv, Dv]."""
    kd = w.num_key_heads * w.key_head_dim
    q, k, v = mixed.split([kd, kd, mixed.shape[-1] - 2 * kd], dim=-1)
    lead = mixed.shape[:-1]
    return (q.reshape(*lead, w.num_key_heads, w.key_head_dim), k.reshape(*lead, w.num_key_heads, w.key_head_dim),
            v.reshape(*lead, w.num_value_heads, w.value_head_dim))


def gated_deltanet(x: Tensor, w: DeltaNetWeights, meta: BatchMeta, state: LayerState) -> Tensor:
    """x [T, H] -> [T, H]. state: this layer's slots, read for each sequence from meta.state_slots and
    written back (a chunk at position 0 starts from zero whatever its slot holds)."""
    t = x.shape[0]
    hv, dv = w.num_value_heads, w.value_head_dim
    c = w.conv.shape[0]
    vd = hv * dv
    mixed, z, b, a = linear(x, w.in_proj).split([c, vd, hv, hv], dim=-1)
    beta = torch.sigmoid(b)  # [T, Hv]
    g = -w.decay_rate * F.softplus(a.float() + w.dt_bias)  # [T, Hv] log decays
    out = torch.empty(t, hv, dv, dtype=torch.float32)  # [T, Hv, Dv]
    slots = meta.state_slots
    nd = meta.num_decode
    if nd:
        ds = slots[:nd]
        y, conv = conv_step(mixed[:nd], w.conv, state.conv.index_select(0, ds))  # [B, C]
        state.conv.index_copy_(0, ds, conv.to(state.conv.dtype))
        o, ssm = recurrent_step(*split_qkv(y, w), g[:nd], beta[:nd], state.ssm.index_select(0, ds))
        state.ssm.index_copy_(0, ds, ssm)
        out[:nd] = o
    for i, ch in enumerate(meta.chunks):
        slot, sl, fresh = int(slots[nd + i]), slice(ch.start, ch.start + ch.length), ch.start_pos == 0
        conv0 = torch.zeros_like(state.conv[slot]) if fresh else state.conv[slot]
        y, conv = conv_prefill(mixed[sl], w.conv, conv0)  # [n, C]
        state.conv[slot].copy_(conv)
        ssm0 = torch.zeros_like(state.ssm[slot]) if fresh else state.ssm[slot]
        out[sl], ssm = chunked(*split_qkv(y, w), g[sl], beta[sl], ssm0)
        state.ssm[slot].copy_(ssm)
    normed = gated_rms_norm(out.to(x.dtype), z.view(t, hv, dv), w.norm, w.norm_eps)  # [T, Hv, Dv]
    return linear(normed.reshape(t, vd), w.out)
