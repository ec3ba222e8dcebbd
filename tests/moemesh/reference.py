"""transformers as the reference: prompt log-probabilities, greedy continuations and their margins."""
from __future__ import annotations

import torch


def hf_prompt_logprobs(model, prompt: list[int]) -> list[float]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, from transformers' logits (float32 log-softmax)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))]


def hf_greedy(model, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of n tokens and, per step, the top-1 minus top-2 logit margin."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt):].tolist()
    margins = []
    for s in out.scores:
        top2 = torch.topk(s[0].float(), 2).values
        margins.append((top2[0] - top2[1]).item())
    return tokens, margins

