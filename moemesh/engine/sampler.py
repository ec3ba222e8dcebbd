"""Sampling the next token of each request from its logits row.

Shape legend: B requests in the step, V vocab.
Each request samples with its own torch.Generator, so its tokens do not depend on its batch neighbours.
"""
from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from moemesh.engine.sampling_params import SamplingParams


def filter_logits(logits: Tensor, top_k: int, top_p: float) -> Tensor:
    """logits [V] float32 (already temperature-scaled) -> [V] with tokens outside top-k / top-p at -inf."""
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass of the tokens before it already reaches top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> tuple[list[int], list[float]]:
    """logits [B, V] float32 -> (token id per row, its log-probability under the unmodified distribution)."""
    logprobs = torch.log_softmax(logits, dim=-1)  # [B, V]
    tokens = torch.argmax(logits, dim=-1)  # [B]
    for b, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        row = filter_logits(logits[b] / p.temperature, p.top_k, p.top_p)
        probs = torch.softmax(row, dim=-1)
        tokens[b] = torch.multinomial(probs, 1, generator=gen)[0]
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]  # [B]
    return tokens.tolist(), chosen.tolist()


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
