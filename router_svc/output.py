"""`OutputAssembler`: turns one sequence's token updates into client deltas.

Detokenizes incrementally, holds back text that might begin a stop string, and reports when a stop
string matched (the router then ends the sequence with finish_reason "stop"). Without a tokenizer
the deltas carry token ids only. With `token_texts` each delta also carries every token's own text
and its top candidates' texts (for logprobs in the HTTP APIs).
"""
from __future__ import annotations

from router_svc.types import Delta, Finished, SequenceUpdate, TokenLogprob


class OutputAssembler:
    def __init__(self, prompt_token_ids: tuple[int, ...], stops: tuple[str, ...], tokenizer=None, token_texts: bool = False) -> None:
        from moemesh.tokenizer import IncrementalDetokenizer, StopStringMatcher

        self.prompt_token_ids = prompt_token_ids
        self._tok = tokenizer
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids) if tokenizer is not None else None
        self._stops = StopStringMatcher(stops) if stops else None
        self._token_texts = token_texts
        self.completion_tokens = 0
        self.prompt_logprobs: tuple[float | None, ...] = ()
        self.stop_string = ""
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
        first = self.completion_tokens == 0
        self.completion_tokens += len(update.token_ids)
        text = "".join(self._detok.push(t) for t in update.token_ids) if self._detok is not None else ""
        if self._detok is not None and update.finish_reason:
            text += self._detok.flush()
        if self._stops is not None:
            match = self._stops.feed(text)
            text = match.text
            self.stop_string = match.stop or ""
            if update.finish_reason and not self._stops.stopped:
                text += self._stops.flush()
        return Delta(
            text=text, token_ids=update.token_ids, logprobs=update.logprobs,
            tokens=tuple(self._text(t) for t in update.token_ids) if self._token_texts else (),
            top_logprobs=tuple(tuple(TokenLogprob(t, self._text(t), lp) for t, lp in top) for top in update.top_logprobs),
            prompt_tokens=len(self.prompt_token_ids) if first else None,
            completion_tokens=self.completion_tokens,
            cached_tokens=self.cached_tokens if first else 0,
        )

    def _text(self, token_id: int) -> str:
        if self._tok is None:
            return ""
        return self._tok.decode([token_id], skip_special_tokens=False)

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
            stop_string=self.stop_string,
            cached_tokens=self.cached_tokens,
        )
