"""Sampling parameters: the plain type every layer shares (it imports nothing of ours)."""

from __future__ import annotations

import math
from dataclasses import dataclass


class InvalidRequest(ValueError):
    """Bad input from a client (an HTTP 400)."""


INT32_MAX = 2**31 - 1  # lengths, counts and indices go into int32 tensors
# Below this a temperature is greedy: the logits over it would overflow float32 (the softmax
# of a huge logit gap is a point mass anyway), so greedy is the only faithful answer.
MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below MIN_TEMPERATURE: greedy
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
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    def __post_init__(self) -> None:
        """Every value within what the sampler stores it in; a message names the field."""
        _check_int("max_tokens", self.max_tokens, 1, INT32_MAX)
        _check_float("temperature", self.temperature, 0.0, 100.0)
        _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _check_int("top_k", self.top_k, 0, INT32_MAX)
        _check_float("min_p", self.min_p, 0.0, 1.0)
        _check_float("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_float("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_float("repetition_penalty", self.repetition_penalty, 0.01, 100.0)
        if self.seed is not None:
            _check_int("seed", self.seed, 0, 2**63 - 1)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, 20)
        if self.num_speculative_tokens is not None:
            _check_int("num_speculative_tokens", self.num_speculative_tokens, 0, INT32_MAX)
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT32_MAX)
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, 0, INT32_MAX)
            _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not all(self.stop):
            raise InvalidRequest("stop strings must not be empty")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _check_float(name: str, value: object, lo: float, hi: float, low_open: bool = False) -> None:
    number = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
    above = number and (value > lo if low_open else value >= lo)  # type: ignore[operator]
    if not (above and value <= hi):  # type: ignore[operator]
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name} must be a number in {bracket}{lo:g}, {hi:g}], got {value!r}")
