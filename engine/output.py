"""Streaming out: turn a request's emitted tokens into deltas, and decide when it finishes."""

from __future__ import annotations

from core.request import Delta, FinishReason, Request, TokenLogprob, Usage
from models.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputStream:
    """One request's output: finish checks, incremental text and stop strings. It is the one
    writer of the request's `output_ids` and `finish_reason`.

    Stop strings are never streamed, even when split across tokens: text that could be the
    start of a stop string is held back until the next tokens decide it. The output ends with
    the token that finishes it (eos, a stop token, the limit, or the token whose text completes
    a stop string): tokens a speculative step emitted past it are dropped, so that the tokens
    and the usage a request reports do not depend on how many tokens its steps emitted.
    """

    def __init__(self, request: Request, tokenizer: Tokenizer, max_model_len: int):
        self.request = request
        self.params = request.params
        self.eos = None if request.params.ignore_eos else tokenizer.eos_token_id
        self.max_model_len = max_model_len
        self.detokenizer = IncrementalDetokenizer(tokenizer, request.prompt_ids)
        self.held = ""  # text withheld because it may begin a stop string
        self.usage = Usage(len(request.prompt_ids), 0)
        self.last_token_time: float | None = None  # for inter-token latency

    def add(self, tokens: list[int], logprobs: list[TokenLogprob] | None) -> Delta:
        """Append emitted tokens (up to the one that finishes the output) and return the delta."""
        request, kept, text = self.request, [], ""
        # with stop strings each token's text decides whether the next one is kept
        step = 1 if self.params.stop else max(len(tokens), 1)
        for start in range(0, len(tokens), step):
            run = self._append(tokens[start : start + step])
            kept += run
            text += self._text(run)
            if request.finish_reason is not None:
                break
        self.usage.completion_tokens = len(request.output_ids)
        delta = Delta(request.request_id, kept, text, logprobs[: len(kept)] if logprobs else None)
        if request.finish_reason is not None:
            delta.finish_reason = request.finish_reason
            delta.usage = self.usage
        return delta

    def _append(self, tokens: list[int]) -> list[int]:
        """Append tokens to the output up to the first that finishes it; those appended."""
        for n, token in enumerate(tokens, 1):
            self.request.output_ids.append(token)
            self.request.finish_reason = self._finish_reason(token)
            if self.request.finish_reason is not None:
                return tokens[:n]
        return tokens

    def _finish_reason(self, token: int) -> FinishReason | None:
        params, request = self.params, self.request
        if token == self.eos or token in params.stop_token_ids:
            return FinishReason.STOP  # a grammar's dead end too: it allows eos alone
        if len(request.output_ids) >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _text(self, tokens: list[int]) -> str:
        new = self.detokenizer.add(tokens)
        if self.request.finish_reason is not None:
            new += self.detokenizer.flush()
        if not self.params.stop:
            return new
        text = self.held + new
        hit = min((i for s in self.params.stop if (i := text.find(s)) >= 0), default=-1)
        if hit >= 0:
            self.request.finish_reason = FinishReason.STOP
            self.held = ""
            return text[:hit]
        if self.request.finish_reason is not None:
            self.held = ""
            return text
        keep = _partial_stop(text, self.params.stop)
        self.held = text[len(text) - keep :] if keep else ""
        return text[: len(text) - keep]

    def count_drafts(self, drafted: int, accepted: int, by: str | None = None) -> None:
        """A speculative step's drafts, in the usage the request reports (without the tokens
        the grammar forced, which count_forced counts); `by`: the drafter a policy chose."""
        self.usage.spec_steps += 1
        self.usage.draft_tokens += drafted
        self.usage.accepted_tokens += accepted
        if by:
            counts = self.usage.by_drafter.setdefault(by, [0, 0])
            counts[0] += drafted
            counts[1] += accepted

    def count_forced(self, forced: int) -> None:
        self.usage.forced_tokens += forced

    def count_cached(self, cached: int) -> None:
        """The prompt tokens a prefix-cache hit brought at its first prefill."""
        self.usage.cached_tokens = cached

    def finish(self, reason: FinishReason, error: str | None = None) -> Delta:
        """The last delta of a request ended from outside (abort, error)."""
        self.request.finish_reason = reason
        return Delta(self.request.request_id, [], "", None, reason, error, self.usage)


def _partial_stop(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest suffix of text that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:n]):
                best = n
                break
    return best
