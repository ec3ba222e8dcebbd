"""Rotary tables for the default and YaRN rope types, and the MLA softmax scale (DeepSeek's mscale).

Shape legend: P positions, D rotary dims (may be a fraction of the head dim), T tokens, NH heads.

YaRN (arXiv 2309.00071, as DeepSeek-V3 and gpt-oss configure it): frequencies whose wavelength is
short compared with the pre-training context keep their value (extrapolation), long ones are divided by
`factor` (interpolation), with a linear ramp in between; cos/sin are multiplied by the attention
factor `mscale(factor, mscale) / mscale(factor, mscale_all_dim)` (or `0.1 ln(factor) + 1`).
DeepSeek additionally multiplies the softmax scale by `mscale(factor, mscale_all_dim)^2`.
"""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from moemesh.models.layers import RotaryTable, apply_rope

ROPE_TYPES = ("default", "yarn")


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(rope: dict[str, Any], rotary_dim: int, max_position_embeddings: int) -> tuple[Tensor, float]:
    """rope: the config's rope parameters (`rope_theta`, `rope_type`, YaRN fields).
    Returns inv_freq [D/2] float32 and the attention factor applied to cos/sin."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise ValueError(f"rope_parameters.rope_type must be one of {ROPE_TYPES}, got {rope_type!r}")
    if rotary_dim <= 0 or rotary_dim % 2:
        raise ValueError(f"rotary_dim must be a positive even number, got {rotary_dim}")
    base = float(rope.get("rope_theta", 10000.0))
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim  # [D/2]
    pos_freqs = base**exponents
    if rope_type == "default":
        return 1.0 / pos_freqs, 1.0

    original = int(rope.get("original_max_position_embeddings") or max_position_embeddings)
    factor = rope.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original
    attention_factor = rope.get("attention_factor")
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if attention_factor is None:
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = float(rope.get("beta_fast") or 32)
    beta_slow = float(rope.get("beta_slow") or 1)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)  # [D/2]
    extrapolate = 1 - ramp  # 1 keeps the original frequency, 0 divides it by factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def build_rotary_table(rope: dict[str, Any], rotary_dim: int, max_position_embeddings: int) -> RotaryTable:
    """cos, sin [P, D] (halves duplicated, attention factor applied) for positions [0, P)."""
    inv_freq, attention_factor = rope_frequencies(rope, rotary_dim, max_position_embeddings)
    freqs = torch.arange(max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)  # [P, D]
    return RotaryTable(cos=emb.cos() * attention_factor, sin=emb.sin() * attention_factor)


def mla_softmax_scale(qk_head_dim: int, rope: dict[str, Any]) -> float:
    """DeepSeek's attention scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim**-0.5
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim"):
        m = yarn_mscale(float(rope.get("factor") or 1.0), float(rope["mscale_all_dim"]))
        scale = scale * m * m
    return scale


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's interleaved layout: pairs (x0, x1), (x2, x3), ... rotate together.
    x [T, NH, D], cos/sin [T, 1, D] (halves duplicated) -> [T, NH, D] with the rotated pairs
    de-interleaved (evens first, then odds), as transformers lays them out; q and k get the same
    permutation, so their dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def apply_partial_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate-half rope on the first D dims of x [T, NH, Dh] (Dh >= D); the rest passes through."""
    d = cos.shape[-1]
    if d == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat([apply_rope(x[..., :d], cos, sin), x[..., d:]], dim=-1)
