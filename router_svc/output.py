"""`OutputAssembler`: turns one sequence's token updates into client deltas.

Detokenizes incrementally, holds back text that might begin a stop string, and reports when a stop
string matched (the router then ends the sequence with finish_reason "stop"). Without a tokenizer
the deltas carry token ids only.
"""
from __future__ import annotations

from router_svc.types import Delta, Finished, SequenceUpdate


class OutputAssembler:
    def __init__(self, prompt_token_ids: tuple[int, ...], stops: tuple[str, ...], tokenizer=None) -> None:
        from moemesh.tokenizer import IncrementalDetokenizer, StopStringMatcher

        self.prompt_token_ids = prompt_token_ids
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stops = StopStringMatcher(stops) if stops else None
        self.completion_tokens = 0
        self.prompt_logprobs: tuple[float | None, ...] = ()
        self.cached_tokens = 0

    @property
    def stopped(self) -> bool:
        """True once a stop string matched: nothing more goes to the client."""
        return self._stops is not None and self._stops.stopped

    def push(self, update: SequenceUpdate) -> Delta | None:
        """The delta for `update` (None if it carries nothing to send)."""
        if update.prompt_logprobs:
            self.prompt_logprobs = update.prompt_logprobs
        if update.cached_tokens is not None:
            self.cached_tokens = update.cached_tokens
        if self.stopped or not update.token_ids:
            return None
        self.completion_tokens += len(update.token_ids)
        text = "".join(self._detok.push(t) for t in update.token_ids) if self._detok is not None else ""
        if self._detok is not None and update.finish_reason:
            text += self._detok.flush()
        if self._stops is not None:
            text = self._stops.feed(text).text
            if update.finish_reason and not self._stops.stopped:
                text += self._stops.flush()
        return Delta(text=text, token_ids=update.token_ids, logprobs=update.logprobs)

    def tail(self) -> str:
        """Text still held back when the stream ends without a final token (an abort)."""
        text = self._detok.flush() if self._detok is not None else ""
        if self._stops is None:
            return text
        if self._stops.stopped:
            return ""
        return self._stops.feed(text).text + self._stops.flush()

    def finish(self, finish_reason: str) -> Finished:
        return Finished(
            finish_reason=finish_reason,
            prompt_token_ids=self.prompt_token_ids,
            completion_tokens=self.completion_tokens,
            prompt_logprobs=self.prompt_logprobs,
            cached_tokens=self.cached_tokens,
        )
