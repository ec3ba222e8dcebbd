"""Multi-head Latent Attention (DeepSeek-V2/V3, Kimi-K2) over a paged *latent* KV cache.

Shape legend: T tokens, H hidden, NH heads, Rq q_lora_rank, R kv_lora_rank, Dn qk_nope_head_dim,
Dr qk_rope_head_dim, Dv v_head_dim, B decoding sequences, S cached positions per sequence,
n chunk length, L = R + Dr latent width, W = ceil(L / 2).

What the cache holds: per token only `c_kv` [R] (after kv_a_layernorm) and the rotated shared key
`k_pe` [Dr]: R + Dr numbers (576 for DeepSeek-V3) instead of NH * (Dn + Dr + Dv) for expanded heads.

Where it lives: the engine allocates each layer's cache as a (k, v) pair of [num_blocks, BS, KVH, D];
the DeepSeek config sets KVH = 1 and D = W, and `LatentCache` stores a token's latent across the pair
(its first W numbers in k, the rest in v), so no slot is wasted on an unused value tensor.

How attention reads it:
  * decode steps use the *absorbed* form: q_nope is folded through kv_b's key half (W_UK) into the
    latent space, scores are q_lat . c_kv + q_pe . k_pe, the weighted sum stays in latent space and
    kv_b's value half (W_UV) maps it to Dv per head afterwards. Nothing is expanded per cached token.
  * chunks (a prompt, or a part of one) use the *expanded* form: kv_b expands the latents to per-head
    keys/values once and a standard attention runs; this costs less than absorbing when the number of
    queries is near the number of keys. A chunk at position 0 expands its own latents only; one after
    cached positions (prefix cache hit, chunked prefill) gathers the sequence's latents from the cache
    and expands them all.
Both forms compute the same function; tests check each against transformers.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from moemesh.models.batch import BatchMeta
from moemesh.models.deepseek_v3.yarn_rope import apply_rope_interleaved
from moemesh.models.layers import RotaryTable, apply_rope, biased_linear, rms_norm

LATENT_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm use the RMSNorm default, not rms_norm_eps


@dataclass(frozen=True)
class MLAWeights:
    """q_a [Rq, H] + q_a_norm [Rq] + q_b [NH*(Dn+Dr), Rq], or q [NH*(Dn+Dr), H] when q_lora_rank is None;
    kv_a [R+Dr, H]; kv_a_norm [R]; kv_b [NH*(Dn+Dv), R]; o [H, NH*Dv]; biases when attention_bias.
    q, q_a, q_b, kv_a and o may be held quantized by `matmul_layout(w, dense_dtype=...)` (they are only
    multiplied, through `layers.biased_linear`); kv_b is always a plain tensor: it is split per head and
    absorbed into the queries and the output (`absorbed`)."""

    num_heads: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    rope_interleave: bool
    kv_a: Tensor
    kv_a_norm: Tensor
    kv_b: Tensor
    o: Tensor
    q: Tensor | None = None
    q_a: Tensor | None = None
    q_a_norm: Tensor | None = None
    q_b: Tensor | None = None
    q_a_bias: Tensor | None = None
    kv_a_bias: Tensor | None = None
    o_bias: Tensor | None = None

    def __post_init__(self) -> None:
        if (self.q is None) == (self.q_a is None):
            raise ValueError("MLAWeights: give exactly one of q (no q_lora_rank) or q_a/q_a_norm/q_b")

    @property
    def latent_dim(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def absorbed(self) -> tuple[Tensor, Tensor]:
        """kv_b split per head: W_UK [NH, Dn, R], W_UV [NH, Dv, R]."""
        nh, dn, dv = self.num_heads, self.qk_nope_head_dim, self.v_head_dim
        kv_b = self.kv_b.view(nh, dn + dv, self.kv_lora_rank)
        return kv_b[:, :dn], kv_b[:, dn:]


def latent_slot_width(latent_dim: int) -> int:
    """W: the per-token width of each of k and v holding a latent of `latent_dim` numbers."""
    return (latent_dim + 1) // 2


@dataclass(frozen=True)
class LatentCache:
    """A layer's (k, v) pair [num_blocks, BS, 1, W] seen as one latent cache of width L <= 2W."""

    k: Tensor
    v: Tensor
    width: int

    def __post_init__(self) -> None:
        w = self.k.shape[-1]
        if self.k.shape != self.v.shape or self.k.shape[-2] != 1 or w != latent_slot_width(self.width):
            raise ValueError(f"latent cache: k, v must be [blocks, BS, 1, ceil({self.width}/2)], got {list(self.k.shape)}")

    def write(self, slots: Tensor, latent: Tensor) -> None:
        """slots [T] flat slot ids; latent [T, n] with n <= L: the first n numbers of each slot."""
        w, n = self.k.shape[-1], latent.shape[-1]
        if n > self.width:
            raise ValueError(f"latent cache: a latent of {n} numbers does not fit the slot width {self.width}")
        self.k.view(-1, w)[:, : min(n, w)].index_copy_(0, slots, latent[:, :w])
        if n > w:
            self.v.view(-1, w)[:, : n - w].index_copy_(0, slots, latent[:, w:])

    def gather(self, block_tables: Tensor) -> Tensor:
        """block_tables [B, NB] -> latents [B, S, L] of those blocks' slots."""
        b, w = block_tables.shape[0], self.k.shape[-1]
        k = self.k[block_tables].view(b, -1, w)  # [B, S, W]
        v = self.v[block_tables].view(b, -1, w)[..., : self.width - w]  # [B, S, L-W]
        return torch.cat([k, v], dim=-1)


def q_latent(x: Tensor, w: MLAWeights) -> Tensor:
    """x [T, H] -> the normed q LoRA latent [T, Rq] (DeepSeek-V3.2's indexer reads it too)."""
    return rms_norm(biased_linear(x, w.q_a, w.q_a_bias), w.q_a_norm, LATENT_NORM_EPS)


def queries(x: Tensor, w: MLAWeights, q_lat: Tensor | None = None) -> Tensor:
    """x [T, H] -> q [T, NH, Dn+Dr] (before rope); q_lat: `q_latent(x, w)` when already computed."""
    if w.q is not None:
        q = biased_linear(x, w.q, None)
    else:
        q = biased_linear(q_latent(x, w) if q_lat is None else q_lat, w.q_b, None)
    return q.view(x.shape[0], w.num_heads, w.qk_nope_head_dim + w.qk_rope_head_dim)


def rotate(x: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    return apply_rope_interleaved(x, cos, sin) if interleave else apply_rope(x, cos, sin)


@dataclass(frozen=True)
class MLAInputs:
    """One step's rotated queries and new latents: q_nope [T, NH, Dn], q_pe [T, NH, Dr], c_kv [T, R],
    k_pe [T, Dr]; q_lat [T, Rq] (None without q LoRA)."""

    q_nope: Tensor
    q_pe: Tensor
    c_kv: Tensor
    k_pe: Tensor
    q_lat: Tensor | None

    @property
    def latent(self) -> Tensor:
        """[T, R+Dr]: what the cache holds per token."""
        return torch.cat([self.c_kv, self.k_pe], dim=-1)


def mla_inputs(x: Tensor, w: MLAWeights, cos: Tensor, sin: Tensor) -> MLAInputs:
    """x [T, H], cos/sin [T, 1, Dr] -> MLAInputs."""
    r, dn = w.kv_lora_rank, w.qk_nope_head_dim
    q_lat = q_latent(x, w) if w.q is None else None
    q = queries(x, w, q_lat)  # [T, NH, Dn+Dr]
    kv = biased_linear(x, w.kv_a, w.kv_a_bias)  # [T, R+Dr]
    c_kv = rms_norm(kv[:, :r], w.kv_a_norm, LATENT_NORM_EPS)  # [T, R]
    q_pe = rotate(q[..., dn:], cos, sin, w.rope_interleave)  # [T, NH, Dr]
    k_pe = rotate(kv[:, None, r:], cos, sin, w.rope_interleave)[:, 0]  # [T, Dr]
    return MLAInputs(q[..., :dn], q_pe, c_kv, k_pe, q_lat)


def mla_attention(x: Tensor, w: MLAWeights, meta: BatchMeta, rope: RotaryTable, cache: LatentCache) -> Tensor:
    """x [T, H] -> [T, H]; writes this step's latents (c_kv, k_pe) into the cache first."""
    cos, sin = rope.for_positions(meta.positions, x.dtype)  # [T, 1, Dr]
    inp = mla_inputs(x, w, cos, sin)
    cache.write(meta.slot_mapping, inp.latent)
    lat = cache.gather(meta.decode_block_tables) if meta.num_decode else None  # [B, S, R+Dr]
    masks = [c.mask for c in meta.chunks]
    return mla_output(latent_attention(inp, w, meta, lat, meta.decode_mask, chunk_latents(cache, meta), masks), w)


def chunk_latents(cache: LatentCache, meta: BatchMeta) -> list[Tensor | None]:
    """Per chunk: for one after cached positions, the latents [S, L] of its sequence's blocks (this
    chunk's own included: the cache is written first); None for one at position 0 (its own latents
    are this step's)."""
    return [cache.gather(c.block_table[None])[0] if c.start_pos > 0 else None for c in meta.chunks]


def latent_attention(
    inp: MLAInputs, w: MLAWeights, meta: BatchMeta, decode_lat: Tensor | None, decode_mask: Tensor,
    chunk_lat: list[Tensor | None], chunk_masks: list[Tensor | None],
) -> Tensor:
    """-> [T, NH, Dv]. Decodes attend (absorbed) to their cached latents decode_lat [B, S, >= R+Dr] where
    decode_mask [B, S] is True. Chunk i attends (expanded) to chunk_lat[i] [S, >= R+Dr] where
    chunk_masks[i] [n, S] is True or, when chunk_lat[i] is None, to its own tokens: causally when
    chunk_masks[i] is None, else where that [n, n] mask is True (a subset of the causal mask)."""
    t, nh, dv, r, ld = inp.q_nope.shape[0], w.num_heads, w.v_head_dim, w.kv_lora_rank, w.latent_dim
    out = torch.empty(t, nh, dv, dtype=inp.q_nope.dtype)  # [T, NH, Dv]
    b = meta.num_decode
    if b:
        out[:b] = absorbed_decode(inp.q_nope[:b], inp.q_pe[:b], w, decode_lat[..., :ld], decode_mask)
    for c, lat, mask in zip(meta.chunks, chunk_lat, chunk_masks):
        sl = slice(c.start, c.start + c.length)
        if lat is not None:
            out[sl] = expanded_prefill(inp.q_nope[sl], inp.q_pe[sl], lat[:, :r], lat[:, r:ld], w, mask)
        else:
            out[sl] = expanded_prefill(inp.q_nope[sl], inp.q_pe[sl], inp.c_kv[sl], inp.k_pe[sl], w, mask)
    return out


def mla_output(out: Tensor, w: MLAWeights) -> Tensor:
    """out [T, NH, Dv] -> [T, H]."""
    return biased_linear(out.reshape(out.shape[0], w.num_heads * w.v_head_dim), w.o, w.o_bias)


def absorbed_decode(q_nope: Tensor, q_pe: Tensor, w: MLAWeights, lat: Tensor, mask: Tensor) -> Tensor:
    """q_nope [B, NH, Dn], q_pe [B, NH, Dr], cached latents lat [B, S, R+Dr], mask [B, S] (True = attend)
    -> [B, NH, Dv]."""
    r = w.kv_lora_rank
    w_uk, w_uv = w.absorbed()  # [NH, Dn, R], [NH, Dv, R]
    c_kv, k_pe = lat[..., :r], lat[..., r:]  # [B, S, R], [B, S, Dr]
    q_lat = torch.einsum("bnd,ndr->bnr", q_nope, w_uk)  # [B, NH, R]
    scores = torch.einsum("bnr,bsr->bns", q_lat, c_kv) + torch.einsum("bnd,bsd->bns", q_pe, k_pe)  # [B, NH, S]
    scores = (scores.float() * w.softmax_scale).masked_fill(~mask[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q_nope.dtype)  # [B, NH, S]
    o_lat = torch.einsum("bns,bsr->bnr", probs, c_kv)  # [B, NH, R]
    return torch.einsum("bnr,nvr->bnv", o_lat, w_uv)  # [B, NH, Dv]


def expanded_prefill(q_nope: Tensor, q_pe: Tensor, c_kv: Tensor, k_pe: Tensor, w: MLAWeights, mask: Tensor | None = None) -> Tensor:
    """One chunk of n queries over S latents: q_nope [n, NH, Dn], q_pe [n, NH, Dr], c_kv [S, R], k_pe [S, Dr],
    mask [n, S] (True = attend; None: S == n, the chunk's own keys, causal) -> [n, NH, Dv]."""
    s, nh, dn = c_kv.shape[0], w.num_heads, w.qk_nope_head_dim
    kv = (c_kv @ w.kv_b.t()).view(s, nh, dn + w.v_head_dim)  # [S, NH, Dn+Dv]
    k = torch.cat([kv[..., :dn], k_pe[:, None, :].expand(s, nh, -1)], dim=-1)  # [S, NH, Dn+Dr]
    v = kv[..., dn:]  # [S, NH, Dv]
    q = torch.cat([q_nope, q_pe], dim=-1)  # [n, NH, Dn+Dr]
    o = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, is_causal=mask is None, scale=w.softmax_scale
    )  # [NH, n, Dv]
    return o.transpose(0, 1)
