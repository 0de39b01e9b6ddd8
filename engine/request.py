"""The engine's request API: the plain request types (core/) and the engine's own refusals."""

from __future__ import annotations

from core.params import Grammar, InvalidRequest, SamplingParams
from core.request import Delta, FinishReason, Request, TokenLogprob, Usage

__all__ = [
    "Delta",
    "EngineFailed",
    "FinishReason",
    "Grammar",
    "InvalidRequest",
    "Overloaded",
    "Request",
    "SamplingParams",
    "TokenLogprob",
    "Usage",
]


class Overloaded(RuntimeError):
    """The waiting queue is full (an HTTP 503 with Retry-After)."""


class EngineFailed(RuntimeError):
    """The engine has stopped serving (a hung loop, a run of failed steps): an HTTP 503."""
