"""The gated delta rule, Gated DeltaNet's token mixer (Qwen3-Next, Qwen3.5): a recurrent step for
decodes and a chunked form for prefills; both compute the same function.

Shape legend: B sequences, n tokens of one sequence, Hk key heads, Hv value heads (Hv = r * Hk),
Dk key head dim, Dv value head dim, C chunk size, N chunks.

Per value head h (reading key head h // r) and token t, with state S [Dk, Dv] (float32):
    S <- exp(g_t) * S                                  decay (g_t <= 0)
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T          delta rule: write the part of v_t S does not predict
    o_t = S^T q_t
where q and k are L2-normalised per head (eps 1e-6) and q is scaled by Dk^-0.5. Everything runs in
float32, as transformers' torch fallback does.

The chunked form (the DeltaNet paper's UT transform, as transformers writes it) turns the C updates
of a chunk into a triangular solve and a few matmuls, then scans the N chunks sequentially.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

L2_EPS = 1e-6
CHUNK = 64


def l2norm(x: Tensor) -> Tensor:
    """x [..., D] / ||x|| (eps 1e-6 under the root), as the FLA library computes it."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + L2_EPS)


def prepare(q: Tensor, k: Tensor, num_v_heads: int) -> tuple[Tensor, Tensor]:
    """q, k [..., Hk, Dk] -> float32, one head per value head ([..., Hv, Dk]), L2-normalised, q scaled."""
    r = num_v_heads // q.shape[-2]
    if r > 1:
        q, k = q.repeat_interleave(r, dim=-2), k.repeat_interleave(r, dim=-2)
    q, k = l2norm(q.float()), l2norm(k.float())
    return q * q.shape[-1] ** -0.5, k


def recurrent_step(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One token per sequence: q, k [B, Hk, Dk], v [B, Hv, Dv], g, beta [B, Hv], state [B, Hv, Dk, Dv]
    -> (o [B, Hv, Dv] float32, new state [B, Hv, Dk, Dv] float32)."""
    q, k = prepare(q, k, v.shape[-2])  # [B, Hv, Dk]
    v, g, beta = v.float(), g.float(), beta.float()
    state = state.float() * g.exp()[..., None, None]
    kv_mem = (state * k[..., None]).sum(dim=-2)  # [B, Hv, Dv]: what S predicts for k
    delta = (v - kv_mem) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(dim=-2), state


def recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor) -> tuple[Tensor, Tensor]:
    """One sequence token by token: q, k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv], state [Hv, Dk, Dv]
    -> (o [n, Hv, Dv] float32, final state)."""
    outs = []
    state = state[None]
    for t in range(q.shape[0]):
        o, state = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1], g[t : t + 1], beta[t : t + 1], state)
        outs.append(o)
    return torch.cat(outs), state[0]


def chunked(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor, chunk: int = CHUNK
) -> tuple[Tensor, Tensor]:
    """One sequence in chunks: q, k [n, Hk, Dk], v [n, Hv, Dv], g, beta [n, Hv], state [Hv, Dk, Dv]
    -> (o [n, Hv, Dv] float32, final state [Hv, Dk, Dv] float32)."""
    n, hv = v.shape[0], v.shape[1]
    q, k = prepare(q, k, hv)
    q, k, v = (x.transpose(0, 1) for x in (q, k, v.float()))  # [Hv, n, D]
    g, beta = g.float().transpose(0, 1), beta.float().transpose(0, 1)  # [Hv, n]
    pad = (chunk - n % chunk) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    v_beta, k_beta = v * beta[..., None], k * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(hv, -1, chunk, x.shape[-1]) for x in (q, k, k_beta, v_beta))  # [Hv, N, C, D]
    decay = g.reshape(hv, -1, chunk).cumsum(dim=-1)  # [Hv, N, C]: log of the decay since the chunk's start
    upper = torch.ones(chunk, chunk, dtype=torch.bool).triu(1)
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(upper, float("-inf")).exp()  # [Hv, N, C, C]

    # Within a chunk: the delta-rule updates as a unit lower-triangular system (UT transform)
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    intra = (q @ k.transpose(-1, -2)) * pairwise  # [Hv, N, C, C]
    new_v = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)  # [Hv, N, C, Dv]
    k_cumdecay = torch.linalg.solve_triangular(system, k_beta * decay.exp()[..., None], upper=False, unitriangular=True)

    q = q * decay.exp()[..., None]
    k = k * (decay[..., -1:] - decay).exp()[..., None]
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [Hv, N, 1, 1]
    state = state.float()
    out = torch.empty_like(new_v)
    for i in range(new_v.shape[1]):  # sequential over chunks: read the carried state, then update it
        v_new = new_v[:, i] - k_cumdecay[:, i] @ state  # [Hv, C, Dv]
        out[:, i] = q[:, i] @ state + intra[:, i] @ v_new
        state = state * chunk_decay[:, i] + k[:, i].transpose(-1, -2) @ v_new
    return out.reshape(hv, -1, out.shape[-1])[:, :n].transpose(0, 1), state
