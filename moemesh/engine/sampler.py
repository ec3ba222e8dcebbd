"""Sampling the next token of each request from its logits row.

Shape legend: B requests in the step, V vocab.
Each request samples with its own torch.Generator, so its tokens do not depend on its batch neighbours.
A row that cannot be sampled (non-finite logits from the model, or a sampling failure) fails that
request alone: `sample` returns the exception in its place and the other rows are unaffected.
"""
from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import Tensor

from kernels.cpu.step_ops import argmax_logsumexp as kernel_argmax_logsumexp
from moemesh.engine.sampling_params import SamplingParams

Sampled = tuple[int, float]  # (token id, its log-probability)


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits [V] float32 (already temperature-scaled) -> [V] with tokens outside top-k / top-p at -inf.
    The most likely token always stays (a top_p that rounds to 0 in float32 keeps just it)."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass of the tokens before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def argmax_logsumexp(logits: Tensor) -> tuple[list[int], list[float], list[float]]:
    """logits [B, V] float32 -> per row its first largest entry (a NaN counting as the largest), that
    entry's value and log(sum(exp(row))): one compiled pass per row on the CPU kernels (torch's CPU
    argmax alone takes longer than the rest of the sampler; docs/benchmarks.md), else torch's ops."""
    done = kernel_argmax_logsumexp(logits)
    if done is None:
        ids = torch.argmax(logits, dim=-1)  # [B]
        done = ids, logits.gather(1, ids[:, None])[:, 0], torch.logsumexp(logits, dim=-1)
    ids, top, lse = done
    return ids.tolist(), top.tolist(), lse.tolist()


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> list[Sampled | Exception]:
    """logits [B, V] float32 -> per row (token id, its log-probability under the unmodified
    distribution), or the exception that row failed with: RuntimeError "logits: ..." when the row
    holds NaN or +inf (its distribution is undefined), "sampling: ..." when drawing from it failed."""
    ids, top, lse = argmax_logsumexp(logits)  # log p(token) = logit - lse
    # The log-probability at the argmax is finite exactly when the row is sound: a NaN is its own
    # argmax and makes it NaN, a +inf makes it inf - inf (or lse NaN), and so does a row of only -inf;
    # so one look at B values replaces the checks over all V logits.
    out: list[Sampled | Exception] = []
    for b, (p, gen) in enumerate(zip(params, generators)):
        lp = top[b] - lse[b]
        if not math.isfinite(lp):
            out.append(RuntimeError("logits: the model computed NaN or infinite logits for this sequence"))
            continue
        if p.greedy:
            out.append((ids[b], lp))
            continue
        try:
            row = filter_logits(logits[b] / p.temperature, p.top_k, p.top_p)
            token = int(torch.multinomial(torch.softmax(row, dim=-1), 1, generator=gen)[0])
        except RuntimeError as exc:
            out.append(RuntimeError(f"sampling: drawing the next token failed ({exc})"))
            continue
        out.append((token, float(logits[b, token]) - lse[b]))
    return out


def top_logprobs(logits: Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]] | None]:
    """logits [B, V] float32 -> per row its ks[b] most likely (token id, log-probability) pairs, most
    likely first, under the unmodified distribution (None where ks[b] is 0)."""
    k_max = max(ks, default=0)
    if k_max <= 0:
        return [None] * len(ks)
    values, ids = torch.topk(torch.log_softmax(logits, dim=-1), min(k_max, logits.shape[-1]), dim=-1)  # [B, k_max]
    values, ids = values.tolist(), ids.tolist()
    return [list(zip(ids[b][:k], values[b][:k])) if k > 0 else None for b, k in enumerate(ks)]


def target_logprobs(logits: Tensor, targets: Sequence[int]) -> list[float]:
    """logits [M, V], targets [M] -> log p(targets[i]) under row i, for each i."""
    lp = torch.log_softmax(logits, dim=-1)  # [M, V]
    idx = torch.tensor(list(targets), dtype=torch.long)
    return lp.gather(1, idx[:, None])[:, 0].tolist()
