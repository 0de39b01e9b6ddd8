"""Requests and what the engine streams back for them (plain types)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

from core.params import SamplingParams

PRIOR_RATE = 0.6  # acceptance assumed for a new request: near what the demo pair accepts
PRIOR_WEIGHT = 4.0  # ... worth this many drafted positions
FORGET = 0.95  # per step: recent steps count more (acceptance drifts with the text)
# a lookup's drafts (n-gram, suffix) hold while the text repeats and fail at once where it
# stops: their estimates forget fast, so that a drafter at zero acceptance is dropped within
# a few steps (and, fading back toward the prior while idle at FORGET's slower pace, tried
# again some tens of steps later: a faster return had the pair's lookups retried every few
# steps where the draft model paid, docs/performance.md)
FREE_FORGET = 0.5
FREE_DRAFTERS = ("ngram", "suffix")  # the drafters with no model, by name
MODEL = "model"  # the model's estimate (Request.acceptance) among the drafters' by name
# a new request's prior for each drafter is what it accepted across the engine's recent
# requests (a workload where the text never repeats says so once, not once a request); that
# estimate forgets more slowly and, while the drafter drafts nowhere, fades back to
# PRIOR_RATE, so that it is tried again
ENGINE_FORGET, ENGINE_FADE = 0.98, 0.99


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


class Matcher(Protocol):
    """A grammar's state after a request's tokens (xgrammar's GrammarMatcher)."""

    vocab_size: int  # its masks cover token ids 0 .. vocab_size - 1

    @property
    def stop_token_ids(self) -> list[int]: ...  # the tokens that end the grammar (eos)

    def fill_next_token_bitmask(self, bitmask: Any, index: int) -> Any: ...

    def accept_token(self, token_id: int) -> bool: ...

    def rollback(self, num_tokens: int) -> None: ...

    def is_terminated(self) -> bool: ...

    def find_jump_forward_string(self) -> str: ...  # the text the grammar forces next


@dataclass
class AcceptanceRate:
    """One request's smoothed chance that a draft token is accepted (given its prefix was).

    A step that drafted n tokens and accepted a of them saw a acceptances and, if a < n, one
    rejection; the estimate is acceptances over trials, both decayed by FORGET each step."""

    prior: float = PRIOR_RATE  # where the estimate starts, and returns to while idle
    forget: float = FORGET
    fade: float = FORGET  # per idle step: how fast the evidence returns to the prior
    steps: int = 0  # the steps that drafted
    accepted: float = field(init=False)
    trials: float = field(init=False)

    def __post_init__(self) -> None:
        self.restart(self.prior)

    def restart(self, prior: float) -> None:
        """The prior's evidence alone, from `prior`."""
        self.prior, self.accepted, self.trials = prior, prior * PRIOR_WEIGHT, PRIOR_WEIGHT

    def observe(self, drafted: int, accepted: int) -> None:
        if drafted == 0:
            return
        self.steps += 1
        self.accepted = self.forget * self.accepted + accepted
        self.trials = self.forget * self.trials + accepted + (accepted < drafted)

    def idle(self) -> None:
        """A step that drafted nothing: the evidence fades toward the prior's, by `fade`.
        Without it a low estimate would turn drafting off for good, since only drafting
        shows it otherwise."""
        keep = self.fade
        self.accepted = keep * self.accepted + (1 - keep) * self.prior * PRIOR_WEIGHT
        self.trials = keep * self.trials + (1 - keep) * PRIOR_WEIGHT

    @property
    def rate(self) -> float:
        return min(self.accepted / self.trials, 0.999)


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a step emits in expectation, each draft accepted with probability `rate` given
    the ones before: 1 + rate + ... + rate^drafts."""
    return (1 - rate ** (drafts + 1)) / (1 - rate)


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-n (token id, logprob), best first


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    draft_tokens: int = 0  # draft tokens proposed for this request
    accepted_tokens: int = 0  # of those, accepted by the target
    spec_steps: int = 0  # verify steps that speculated
    # --speculative auto: (draft tokens, accepted) by the drafter that proposed them
    by_drafter: dict[str, list[int]] = field(default_factory=dict)
    # tokens the request's grammar forced (the only one it allowed): completion tokens, and
    # counted neither as drafted nor as accepted, though drafted for free where a step drafted
    forced_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV a prefix-cache hit brought


@dataclass
class Delta:
    """New output of one request: tokens, their text, and on the last delta the finish."""

    request_id: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    error: str | None = None  # set with FinishReason.ERROR
    usage: Usage | None = None  # set on the last delta
    # per token of token_ids: the drafter that proposed it and the target accepted, None for
    # the target's own (a step's last token, and every token of a step that did not draft)
    drafted: list[str | None] | None = None
    # with the error: the same request may succeed if sent again (the replica serving it
    # stopped, or none took it), which a non-streamed answer says with a 503
    unavailable: bool = False


@dataclass
class Request:
    """Host-side state of one request. Its output (`output_ids`, `finish_reason`) is written
    by its OutputStream alone (engine/output.py), its progress (`inflight`, `acceptance`) by
    the scheduler alone (engine/scheduler.py), its grammar's `matcher` by the step's device
    stages and, for host drafts, its plan (stages/grammar.py), one at a time; the rest never
    changes."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    inflight: int = 0  # scheduled steps whose tokens are not yet known on the host
    acceptance: AcceptanceRate = field(default_factory=AcceptanceRate)  # for the cost model
    # --speculative auto: the acceptance of each drafter with no model (n-gram, suffix) for
    # this request, by name; the model's is `acceptance`
    free_rates: dict[str, AcceptanceRate] = field(
        default_factory=lambda: {
            name: AcceptanceRate(forget=FREE_FORGET, fade=FORGET) for name in FREE_DRAFTERS
        }
    )
    matcher: Matcher | None = None  # structured output: the grammar after the committed tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids


class Overloaded(RuntimeError):
    """The waiting queue is full (an HTTP 503 with Retry-After)."""


class EngineFailed(RuntimeError):
    """The engine has stopped serving (a hung loop, a run of failed steps): an HTTP 503."""
