"""`PromptArgs`: the prompt and sampling flags `moemesh run` and `moemesh generate` share (same
names, same defaults; the flags derive from the fields through `moemesh.svc_config`)."""
from __future__ import annotations

from dataclasses import dataclass, field

from moemesh.engine.sampling_params import SamplingParams


def parse_prompt_ids(text: str) -> tuple[int, ...]:
    try:
        ids = tuple(int(t) for t in text.split(",") if t.strip())
    except ValueError:
        raise ValueError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None
    if not ids:
        raise ValueError("--prompt-ids must name at least one token id")
    return ids


@dataclass(frozen=True)
class PromptArgs:
    prompt: str | None = field(default=None, metadata={"help": "prompt text (wrapped in the chat template when the model has one)", "metavar": "TEXT"})
    prompt_ids: str | None = field(default=None, metadata={"help": "prompt as comma-separated token ids (no tokenizer needed)", "metavar": "1,2,3"})
    raw_prompt: bool = field(default=False, metadata={"help": "do not apply the chat template to --prompt"})
    max_new_tokens: int = field(default=128, metadata={"metavar": "N"})
    temperature: float = field(default=0.0, metadata={"help": "0 = greedy", "metavar": "T"})
    top_p: float = field(default=1.0, metadata={"metavar": "P"})
    top_k: int = field(default=0, metadata={"help": "0 = off", "metavar": "K"})
    seed: int | None = field(default=None, metadata={"metavar": "S"})

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.prompt_ids is None):
            raise ValueError("one of --prompt and --prompt-ids is required, not both")
        if self.prompt_ids is not None:
            parse_prompt_ids(self.prompt_ids)
        self.sampling_params()  # the sampling values are checked here, before any model is loaded or called

    @property
    def token_ids(self) -> tuple[int, ...] | None:
        """The --prompt-ids as ints (None with --prompt)."""
        return None if self.prompt_ids is None else parse_prompt_ids(self.prompt_ids)

    def sampling_params(self, stop_token_ids: tuple[int, ...] = (), prompt_logprobs: bool = False) -> SamplingParams:
        return SamplingParams(
            max_new_tokens=self.max_new_tokens, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
            seed=self.seed, stop_token_ids=stop_token_ids, prompt_logprobs=prompt_logprobs,
        )
