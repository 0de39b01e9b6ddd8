"""Sampling parameters and their per-batch tensor form: plain types every layer shares."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any

import torch


class InvalidRequest(ValueError):
    """Bad input from a client (an HTTP 400)."""


INT32_MAX = 2**31 - 1  # lengths, counts and indices go into int32 tensors
# Below this a temperature is greedy: the logits over it would overflow float32 (the softmax
# of a huge logit gap is a point mass anyway), so greedy is the only faithful answer.
MIN_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token, 100 all but forces it


GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "choice", "ebnf")


@dataclass(frozen=True)
class Grammar:
    """What a request's output must match (structured output). `source` is, by kind: a JSON
    schema (serialised), nothing (any JSON object), a regular expression, a JSON list of the
    allowed strings, or a grammar in xgrammar's EBNF. Hashable: compiled grammars are cached
    by it."""

    kind: str
    source: str = ""

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise InvalidRequest(f"grammar kind must be one of {', '.join(GRAMMAR_KINDS)}")


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
    # per-request drafter, one of the server's (SpecConfig.drafters; "none": no speculation)
    speculative_method: str | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    grammar: Grammar | None = None  # structured output: what the output must match

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
        if self.speculative_method is not None and not isinstance(self.speculative_method, str):
            raise InvalidRequest("speculative_method must be a string")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids", token_id, 0, INT32_MAX)
        for token_id, bias in self.logit_bias:
            _check_int("logit_bias", token_id, 0, INT32_MAX)
            _check_float("logit_bias", bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        if not all(self.stop):
            raise InvalidRequest("stop strings must not be empty")
        if self.grammar is not None and self.ignore_eos:
            raise InvalidRequest("ignore_eos cannot be set with a grammar, which ends at eos")

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


@dataclass(frozen=True)
class SamplerLoad:
    """A batch's requests whose rows cost the sampler more than a greedy row's argmax: those
    drawn by the inverse CDF, and those drawn by the seeded coupling (its noise over the whole
    vocabulary a row). The cost model prices each row of theirs (engine/cost.py)."""

    drawn: int = 0
    coupled: int = 0

    @classmethod
    def of(cls, params: list[SamplingParams]) -> SamplerLoad:
        sampled = [p for p in params if not p.greedy]
        coupled = sum(p.seed is not None for p in sampled)
        return cls(len(sampled) - coupled, coupled)


def _check_int(name: str, value: object, lo: int, hi: int) -> None:
    if type(value) is not int or not lo <= value <= hi:
        raise InvalidRequest(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")


def _check_float(name: str, value: object, lo: float, hi: float, low_open: bool = False) -> None:
    number = type(value) in (int, float) and math.isfinite(value)  # type: ignore[arg-type]
    above = number and (value > lo if low_open else value >= lo)  # type: ignore[operator]
    if not (above and value <= hi):  # type: ignore[operator]
        bracket = "(" if low_open else "["
        raise InvalidRequest(f"{name} must be a number in {bracket}{lo:g}, {hi:g}], got {value!r}")


@dataclass
class SamplingTensors:
    """Per-row sampling parameters of a batch, on the device.

    The flags are host-side summaries (no device sync to read them) that let callers skip
    work; their defaults are the safe ones for tensors built by hand.
    """

    temperature: torch.Tensor  # [B] float32, 0 = greedy
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] float32, 1 = off
    min_p: torch.Tensor  # [B] float32, 0 = off
    presence_penalty: torch.Tensor  # [B] float32
    frequency_penalty: torch.Tensor  # [B] float32
    repetition_penalty: torch.Tensor  # [B] float32, 1 = off
    seeds: torch.Tensor  # [B] int64
    logit_bias: torch.Tensor | None = None  # [B, V] float32 added to the logits; None: none
    # [B] bool: sampled rows of seeded requests, which draw by the seeded coupling
    # (stages/rng.py), so that speculation cannot change their tokens; None: no such row
    coupled: torch.Tensor | None = None
    all_greedy: bool = False
    any_greedy: bool = True
    any_penalty: bool = True
    any_top_k_or_p: bool = True  # among the sampled rows
    any_min_p: bool = True  # among the sampled rows

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        device: torch.device | str,
        vocab_size: int | None = None,  # needed when a request brings a logit_bias
        pin: bool = False,  # page-locked host memory, which a GPU copies from asynchronously
    ) -> SamplingTensors:
        def column(values: list, dtype: torch.dtype) -> torch.Tensor:
            tensor = torch.tensor(values, dtype=dtype, device=device)
            return tensor.pin_memory() if pin else tensor

        f32 = torch.float32
        sampled = [p for p in params if not p.greedy]
        coupled = [p.seed is not None and not p.greedy for p in params]
        return cls(
            temperature=column([0.0 if p.greedy else p.temperature for p in params], f32),
            top_k=column([p.top_k for p in params], torch.int64),
            top_p=column([p.top_p for p in params], f32),
            min_p=column([p.min_p for p in params], f32),
            presence_penalty=column([p.presence_penalty for p in params], f32),
            frequency_penalty=column([p.frequency_penalty for p in params], f32),
            repetition_penalty=column([p.repetition_penalty for p in params], f32),
            # any Python int seed, wrapped into int64 (two's complement)
            seeds=column([(s + 2**63) % 2**64 - 2**63 for s in seeds], torch.int64),
            logit_bias=_bias_rows(params, vocab_size, device, pin),
            coupled=column(coupled, torch.bool) if any(coupled) else None,
            all_greedy=not sampled,
            any_greedy=len(sampled) < len(params),
            any_penalty=any(
                p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1
                for p in params
            ),
            any_top_k_or_p=any(p.top_k > 0 or p.top_p < 1 for p in sampled),
            any_min_p=any(p.min_p > 0 for p in sampled),
        )

    def to(self, device: torch.device) -> SamplingTensors:
        """The tensors on `device`, copied without blocking the host (from pinned memory
        on a GPU); itself where they are there already."""
        if self.temperature.device == device:
            return self

        tensors = {f.name: getattr(self, f.name) for f in fields(self)}
        moved: dict[str, Any] = {
            name: value.to(device, non_blocking=True)
            for name, value in tensors.items()
            if isinstance(value, torch.Tensor)
        }
        return replace(self, **moved)


def _bias_rows(
    params: list[SamplingParams], vocab_size: int | None, device: torch.device | str, pin: bool
) -> torch.Tensor | None:
    """[B, V] the requests' logit biases, dense; None when no request has one."""
    if not any(p.logit_bias for p in params):
        return None
    if vocab_size is None:
        raise ValueError("a logit_bias needs the vocabulary size")
    bias = torch.zeros(len(params), vocab_size, dtype=torch.float32)
    for row, p in enumerate(params):
        for token_id, value in p.logit_bias:
            if not 0 <= token_id < vocab_size:
                raise ValueError(f"logit_bias token id {token_id} is outside the vocabulary")
            bias[row, token_id] = value
    bias = bias.to(device)
    return bias.pin_memory() if pin else bias
