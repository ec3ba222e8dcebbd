"""`SamplingParams`: how one request samples and when it stops; validated on construction."""
from __future__ import annotations

import math
from dataclasses import dataclass

# A temperature below this samples greedily: dividing logits by it would overflow float32 (and
# the distribution it stands for is the argmax anyway), as in vLLM.
GREEDY_TEMPERATURE = 1e-5
# torch.Generator.manual_seed takes any value in [-2^63, 2^64).
SEED_RANGE = (-(2**63), 2**64)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 (or below GREEDY_TEMPERATURE) = greedy; top_k 0 = off; top_p 1 = off (a top_p
    so small it rounds to 0 keeps the top token); seed None = nondeterministic.
    Generation stops at max_new_tokens, or at a token in stop_token_ids or (unless ignore_eos) the
    model's EOS ids; the stop token is included in the output. prompt_logprobs: also report the
    log-probability of each prompt token given the tokens before it. top_logprobs: also report the
    k most likely tokens (and their log-probabilities) at each generated position.
    Every rejected value raises ValueError with a message that starts with the field's name."""

    max_new_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    prompt_logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: must be >= 1, got {self.max_new_tokens}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if not (math.isfinite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k: must be >= 0 (0 = off), got {self.top_k}")
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise ValueError(f"seed: must be in [-2^63, 2^64), got {self.seed}")
        if self.top_logprobs < 0:
            raise ValueError(f"top_logprobs: must be >= 0 (0 = none), got {self.top_logprobs}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def check_fits(self, prompt_len: int, max_model_len: int) -> None:
        """Raises ValueError when the prompt plus max_new_tokens exceeds the context length."""
        if prompt_len < 1:
            raise ValueError("prompt_token_ids: must hold at least one token")
        if prompt_len >= max_model_len:
            raise ValueError(f"prompt_token_ids: prompt of {prompt_len} tokens does not fit the context of {max_model_len}")
        if prompt_len + self.max_new_tokens > max_model_len:
            raise ValueError(
                f"max_new_tokens: prompt ({prompt_len}) + max_new_tokens ({self.max_new_tokens}) exceeds the context "
                f"length {max_model_len}"
            )
