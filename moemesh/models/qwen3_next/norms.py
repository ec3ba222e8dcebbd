"""The two RMSNorms of Qwen3-Next / Qwen3.5.

Shape legend: T tokens, D normalised dims.

  zero-centred  x / rms(x) * (1 + w), computed in float32 and cast back (input/post-attention/final
                norms, the full-attention q/k norms); weights held as (1 + w) in float32
  gated         (w * (x / rms(x)).to(dtype)) * silu(z), the product in float32 (Gated DeltaNet's
                output norm, a plain weight)
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor


def zero_centered(weight: Tensor) -> Tensor:
    """A checkpoint's zero-centred norm weight w -> the float32 scale (1 + w)."""
    return 1.0 + weight.float()


def scaled_rms_norm(x: Tensor, scale: Tensor, eps: float) -> Tensor:
    """x [..., D], scale float32 (from zero_centered) [D] or broadcasting against x (e.g. one row per
    head) -> [..., D] in x.dtype."""
    if scale.dim() == 1:
        return F.rms_norm(x.float(), (x.shape[-1],), scale, eps).to(x.dtype)
    return (F.rms_norm(x.float(), (x.shape[-1],), None, eps) * scale).to(x.dtype)


def gated_rms_norm(x: Tensor, z: Tensor, weight: Tensor, eps: float) -> Tensor:
    """x, z [..., D], weight [D] -> [..., D] in x.dtype."""
    normed = F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)
    return ((weight * normed).float() * F.silu(z.float())).to(x.dtype)
