"""The transformers reference outputs (prompt logprobs, greedy continuations) the DeepSeek-V3 /
GLM-4.5 MoE / gpt-oss models are held to (their tiny checkpoints: tests/fixtures/checkpoints.py)."""
from __future__ import annotations

import torch


def prompt_logprobs(model, ids: list[int]) -> list[float | None]:
    """log p(ids[i] | ids[:i]) for i >= 1 (None for the first), float64 from float32 logits."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()  # [n, V]
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [float(lp[i - 1, t]) for i, t in enumerate(ids) if i > 0]


def greedy(model, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


def assert_logprobs_close(got, ref, tol: float = 1e-4) -> None:
    assert got[0] is None and ref[0] is None
    assert len(got) == len(ref)
    worst = max(abs(a - b) for a, b in zip(got[1:], ref[1:]))
    assert worst < tol, f"max |logprob diff| {worst:.3g} >= {tol}"
