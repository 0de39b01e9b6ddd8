"""Requests, their sampling parameters, and what the engine streams back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.cost import AcceptanceRate


class InvalidRequest(ValueError):
    """Bad input from a client (an HTTP 400)."""


class Overloaded(RuntimeError):
    """The waiting queue is full (an HTTP 503 with Retry-After)."""


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: no logprobs; n: the chosen token's and the top n
    num_speculative_tokens: int | None = None  # per-request cap on k

    def __post_init__(self) -> None:
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= 0, f"top_k must be >= 0, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in 0..20"),
            (
                self.num_speculative_tokens is None or self.num_speculative_tokens >= 0,
                "num_speculative_tokens must be >= 0",
            ),
            (all(s for s in self.stop), "stop strings must not be empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequest(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


class FinishReason(enum.StrEnum):
    STOP = "stop"  # eos, a stop string or a stop token
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"
    ERROR = "error"


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


@dataclass
class Request:
    """Host-side state of one request; the scheduler and the stages own its fields."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    arrival: float
    output_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    inflight: int = 0  # scheduled steps whose tokens are not yet known on the host
    acceptance: AcceptanceRate = field(default_factory=AcceptanceRate)  # for the cost model

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
