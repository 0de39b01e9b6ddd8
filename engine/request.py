"""Requests, their sampling parameters, and what the engine streams back."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from core.params import InvalidRequest, SamplingParams  # noqa: F401 - the request API's too
from engine.cost import AcceptanceRate


class Overloaded(RuntimeError):
    """The waiting queue is full (an HTTP 503 with Retry-After)."""


class EngineFailed(RuntimeError):
    """The engine has stopped serving (a hung loop, a run of failed steps): an HTTP 503."""


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
