"""The decode step's small operations on the compiled CPU kernels (kernels/cpu/csrc/step_ops.cpp):
RMSNorm (after the residual add), the per-head q/k RMSNorm with rope, decode attention over the paged
KV cache, the softmax top-k routing plan, the sampler's argmax and logsumexp of the logits rows; and
a decoder layer's whole attention half of a decode step (those operations and its projections) in one
call (`decode_layer`, kernels/cpu/csrc/decode_layer.cpp), and for a MoE layer whose experts this
process holds, that call followed by the routed expert MLP on its plan, for a run of consecutive MoE
layers (`decode_layers_experts`): their whole decode step in one call.

Each is one compiled call where the torch code it replaces dispatches several ops; the numbers agree
with that code to float rounding (same rounding points, float32 sums in another order). Each returns
None where it does not run (not on the CPU, another dtype, a layout it does not read, no compiled
kernels, or MOEMESH_CPU_KERNEL=torch): the caller then runs its torch code.

Shape legend: T tokens, R rows per token (heads), D row length, E experts, N = T*K routed rows,
G experts that receive rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Sequence

import torch
from torch import Tensor

from kernels.cpu.build import extension
from kernels.cpu.linear_cpu import kernel_args
from kernels.cpu.moe_mlp_cpu import ACT_CODES, MAX_ROWS_PER_EXPERT, kernel_view
from kernels.cpu.variant import selected_variant
from kernels.experts import ExpertWeights

DTYPES = (torch.float32, torch.bfloat16)


def _ext_for(x: Tensor) -> ModuleType | None:
    """The extension where it runs ops on x (a CPU float32/bfloat16 tensor, a variant selected), else None."""
    if x.dtype not in DTYPES or x.device.type != "cpu" or selected_variant() is None:
        return None
    return extension()


def _reads_rows(x: Tensor, weight: Tensor) -> bool:
    """x [D], [T, D] or [T, R, D] with unit stride along D; weight [D] (or [R, D] for 2+ dims) of x's dtype, contiguous."""
    d = x.shape[-1]
    if not 1 <= x.dim() <= 3 or x.stride(-1) != 1 or weight.dtype != x.dtype or not weight.is_contiguous():
        return False
    return tuple(weight.shape) == (d,) or (x.dim() >= 2 and tuple(weight.shape) == (x.shape[-2], d))


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor | None:
    """x [..., D] -> [..., D] contiguous, x.dtype: round(round(x * rsqrt(mean(x^2) + eps)) * weight)
    (moemesh.models.layers.rms_norm); weight [D] or [R, D] for x [T, R, D]. None where it does not run."""
    ext = _ext_for(x)
    if ext is None or not _reads_rows(x, weight):
        return None
    return ext.rms_norm(x, weight, eps)


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor] | None:
    """x, residual [T, D] -> (x + residual, rms_norm(x + residual, weight)), both [T, D] in x.dtype.
    None where it does not run."""
    ext = _ext_for(x)
    if (
        ext is None or x.dim() != 2 or residual.shape != x.shape or residual.dtype != x.dtype
        or residual.device != x.device or residual.stride(-1) != 1 or not _reads_rows(x, weight)
        or weight.dim() != 1
    ):
        return None
    return ext.add_rms_norm(x, residual, weight, eps)


def qk_norm_rope(heads: Tensor, weight: Tensor | None, eps: float, cos: Tensor, sin_signed: Tensor) -> Tensor | None:
    """heads [T, R, D] -> [T, R, D] contiguous: rms_norm with weight [R, D] (weight None: no norm), then
    moemesh.models.layers.apply_rope_signed with cos / sin_signed [T, 1, D] (heads' dtype).
    None where it does not run."""
    ext = _ext_for(heads)
    if (
        ext is None or heads.dim() != 3 or heads.shape[-1] % 2 or heads.stride(-1) != 1
        or (weight is not None and not _reads_rows(heads, weight))
        or cos.dtype != heads.dtype or sin_signed.dtype != heads.dtype
        or cos.stride(-1) != 1 or sin_signed.stride(-1) != 1
    ):
        return None
    return ext.qk_norm_rope(heads, weight, cos, sin_signed, eps)


def decode_attention(
    q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor, tables: Tensor, mask: Tensor,
) -> Tensor | None:
    """One query token per sequence: q [B, NH, D], k / v [B, KVH, D] (unit stride along D) -> [B, NH, D]
    contiguous; writes k / v into k_cache / v_cache [blocks, BS, KVH, D] at slots [B] first, then
    attends over each sequence's blocks tables [B, NB] where mask [B, NB*BS] is true (scale D^-0.5),
    as moemesh.models.attention.paged_attention's decode rows (SDPA) compute it, on the selected
    variant's inner loops (the plain C++ ones for a head dim they do not take). None where it does
    not run."""
    ext = _ext_for(q)
    if (
        ext is None or k.dtype != q.dtype or v.dtype != q.dtype or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype
        or not k_cache.is_contiguous() or not v_cache.is_contiguous() or q.stride(-1) != 1 or k.stride(-1) != 1
        or v.stride(-1) != 1 or k_cache.device.type != "cpu" or v_cache.device.type != "cpu"
    ):
        return None
    return ext.decode_attention(q, k, v, k_cache, v_cache, slots, tables, mask, selected_variant())


def route_topk(router_logits: Tensor, top_k: int, normalize: bool) -> tuple[Tensor, Tensor, Tensor, Tensor] | None:
    """router_logits [T, E] -> token_idx [N] int64, weights [N] float32, expert_ids [G] int64,
    counts [G] int64: moemesh.moe.dispatch.make_plan's dropless plan of moemesh.moe.gate.softmax_topk.
    None where it does not run."""
    ext = _ext_for(router_logits)
    if ext is None or router_logits.dim() != 2:
        return None
    return ext.route_topk(router_logits, top_k, normalize)


def argmax_logsumexp(logits: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """logits [B, V] float32 -> (ids [B] int64, top [B], lse [B] float32): each row's first largest entry
    (a NaN counts as the largest, as torch.argmax has it), its value, and torch.logsumexp of the row (to
    float rounding), NaN where the row holds a NaN or +inf or only -inf. One compiled call where torch
    runs a pass for each (its CPU argmax alone reads a 49k-entry row about 25x slower). None where it
    does not run."""
    if logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    ext = _ext_for(logits)
    if ext is None:
        return None
    return ext.argmax_logsumexp(logits, selected_variant())


@dataclass(frozen=True)
class DecodeLayer:
    """One decoder layer's attention-half weights handed to the compiled kernels once (`decode_layer_weights`):
    the extension's handle, the compute dtype and variant they were held for, and the most decoding
    rows its projections run on the kernels (more: the caller's own path, which then runs torch's GEMMs)."""

    handle: object
    dtype: torch.dtype
    variant: str
    max_rows: int


def decode_layer_weights(
    input_norm: Tensor, post_norm: Tensor, qkv, o, router, qkv_bias: Tensor | None, qk_norm: Tensor | None,
    num_heads: int, num_kv_heads: int, head_dim: int, eps: float, qk_eps: float,
) -> DecodeLayer | None:
    """The layer's weights as the decoder holds them (norms [H] of the compute dtype; qkv [(NH+2KVH)*D, H],
    o [H, NH*D] and router [E, H] (None: a dense layer) as `moemesh.models.layers.linear` takes them;
    qkv_bias [(NH+2KVH)*D] or None; qk_norm [NH+KVH, D] or None) -> a `DecodeLayer` for `decode_layer`,
    or None where the compiled kernels do not read them all (no variant selected, a oneDNN-packed
    matrix, another device or dtype): the caller then runs its own ops."""
    ext = _ext_for(input_norm)
    if ext is None or input_norm.dim() != 1 or post_norm.dtype != input_norm.dtype:
        return None
    dtype, variant = input_norm.dtype, selected_variant()
    views = [kernel_args(w, dtype, variant) for w in (qkv, o)]
    if router is not None:
        views.append(kernel_args(router, dtype, variant))
    small = [t for t in (qkv_bias, qk_norm) if t is not None]
    if any(v is None for v in views) or any(t.dtype != dtype or t.device.type != "cpu" or not t.is_contiguous() for t in small):
        return None
    handle = ext.DecodeLayer(
        input_norm.contiguous(), post_norm.contiguous(), views[0][0], views[1][0], views[2][0] if router is not None else None,
        qkv_bias, qk_norm, num_heads, num_kv_heads, head_dim, eps, qk_eps,
    )
    return DecodeLayer(handle, dtype, variant, min(v[1] for v in views))


def decode_layer(
    layer: DecodeLayer, x: Tensor, residual: Tensor | None, cos: Tensor, sin_signed: Tensor, k_cache: Tensor,
    v_cache: Tensor, slots: Tensor, tables: Tensor, mask: Tensor, top_k: int, normalize: bool,
) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor, Tensor, Tensor] | None] | None:
    """A decode step's attention half of one layer, for T <= layer.max_rows decoding tokens (one per
    sequence): x [T, H] the residual stream, residual [T, H] the previous layer's MLP output (None for the
    first layer), cos / sin_signed [T, 1, D] (`rope_for_step`), the KV cache, slots, tables and mask as
    `decode_attention` takes them; top_k 0: no routing -> (x + residual, h [T, H] the post-attention
    norm of x + residual + attention, and with top_k > 0 the dropless plan `route_topk` gives for the
    router's logits of h, else None). The decoder's own ops compute the same values
    (moemesh.models.decoder.MoeDecoderLM.forward_stages). None where it does not run (another dtype or
    variant than the layer was held for, more rows): the caller then runs those ops."""
    if x.dtype != layer.dtype or x.dim() != 2 or x.shape[0] > layer.max_rows or selected_variant() != layer.variant:
        return None
    x, h, token_idx, weights, expert_ids, counts = extension().decode_layer(
        layer.handle, x.contiguous(), residual, cos, sin_signed, k_cache, v_cache, slots, tables, mask, top_k, normalize,
        layer.variant,
    )
    return x, h, ((token_idx, weights, expert_ids, counts) if top_k else None)


@dataclass(frozen=True)
class DecodeExperts:
    """One MoE layer's experts handed to the compiled kernels once (`decode_experts_weights`) for
    `decode_layers_experts`: the extension's handle and the kernels' view of the weights it was made
    from (`kernels.cpu.moe_mlp_cpu.kernel_view`; a replaced projection makes a new view)."""

    handle: object
    view: tuple


def decode_experts_weights(w: ExpertWeights) -> DecodeExperts | None:
    """All E experts of a layer (local index == expert id) -> a `DecodeExperts`, or None where the
    compiled kernels do not read them (no compiled extension, a format or layout they do not read, not
    on the CPU): the caller then submits the layer's plan as usual. The handle does not depend on the
    variant: `decode_layers_experts` runs the one its `DecodeLayer`s were held for."""
    ext = extension()
    if ext is None:
        return None
    view = kernel_view(w)
    reason, gu, dn, gu_bias, dn_bias = view
    if reason is not None or w.activation not in ACT_CODES:
        return None
    handle = ext.LayerExperts(gu, gu_bias, dn, dn_bias, ACT_CODES[w.activation], w.intermediate_size)
    return DecodeExperts(handle, view)


def decode_layers_experts(
    layers: Sequence[DecodeLayer], experts: Sequence[DecodeExperts], x: Tensor, residual: Tensor | None, cos: Tensor,
    sin_signed: Tensor, k_caches: Sequence[Tensor], v_caches: Sequence[Tensor], slots: Tensor, tables: Tensor, mask: Tensor,
    top_ks: Sequence[int], normalize: bool,
) -> tuple[Tensor, Tensor] | None:
    """Consecutive MoE layers' decode step in one call: for each, `decode_layer` with routing (its
    top_k >= 1), then its experts on that dropless plan as `kernels.moe_mlp` computes them, its MLP
    output the next layer's residual -> (x + the last residual added, the last layer's MLP output
    [T, H] in x.dtype). Per layer: its `DecodeLayer`, `DecodeExperts`, KV cache and top-k. None where
    it does not run (as `decode_layer` for any of the layers, or more than MAX_ROWS_PER_EXPERT
    tokens): the caller then runs each layer's `decode_layer` and submits its plan."""
    rows = min(MAX_ROWS_PER_EXPERT, *(lyr.max_rows for lyr in layers)) if layers else 0
    variant = selected_variant()
    if (
        not layers or x.dtype != layers[0].dtype or x.dim() != 2 or x.shape[0] > rows or min(top_ks) < 1
        or any(lyr.variant != variant or lyr.dtype != x.dtype for lyr in layers)
    ):
        return None
    return extension().decode_layers_experts(
        [lyr.handle for lyr in layers], [e.handle for e in experts], x.contiguous(), residual, cos, sin_signed,
        list(k_caches), list(v_caches), slots, tables, mask, list(top_ks), normalize, variant,
    )
