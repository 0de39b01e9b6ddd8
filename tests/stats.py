"""Statistical checks shared by the sampling and speculation tests."""

from __future__ import annotations

import math
from typing import Any

import torch

from core.params import SamplingParams, SamplingTensors
from engine.config import EngineConfig
from models.attention import CausalAttention
from models.loader import load_model
from stages.logits import process_logits
from tests.engine_util import make_config

F64 = torch.float64


def chi_square_pvalue(values: torch.Tensor, probs: torch.Tensor) -> float:
    """P-value of `values` (ints in [0, len(probs))) being draws of `probs`; a draw of a
    zero-probability value gives 0."""
    counts = torch.bincount(values, minlength=probs.numel()).to(F64)
    support = probs > 0
    if counts[~support].sum() > 0:
        return 0.0
    expected = counts.sum() * probs[support].to(F64)
    stat = ((counts[support] - expected) ** 2 / expected).sum()
    dof = torch.tensor((int(support.sum()) - 1) / 2, dtype=F64)
    return float(torch.special.gammaincc(dof, stat / 2))


# the speculative law tests: N runs of a TOKENS-token continuation of PROMPT over VOCAB tokens
N = 3000
VOCAB = 6
PROMPT = [1, 2]
TOKENS = 4
PARAMS = dict(temperature=1.0, top_p=0.9, max_tokens=TOKENS, ignore_eos=True)


def law_config(target: Any, method: str, drafter: Any, **kw: Any) -> EngineConfig:
    """The law tests' engine: N requests of PROMPT in one batch, k = 2, 16 tokens a context."""
    return make_config(
        target,
        method,
        drafter,
        k=2,
        pages=3 * N,
        page_size=4,
        max_running=N,
        max_waiting=N,
        # every prompt in one prefill; the draft model's deferred prefill and the first
        # token caught up in the first decode step (its budget: the tokens a row lacks)
        max_batch_tokens=(len(PROMPT) + 1) * N,
        max_model_len=16,
        **kw,
    )


def exact_joint(target_dir) -> dict[tuple[int, ...], float]:
    """P(t1..t4) under the processed target distribution, by enumeration."""
    return enumerate_law(load_model(target_dir), PROMPT, SamplingParams(**PARAMS), TOKENS)


def enumerate_law(
    model, prompt: list[int], params: SamplingParams, tokens: int
) -> dict[tuple[int, ...], float]:
    """P(t1..t_tokens) of a continuation of `prompt` under `model`'s distribution processed
    by `params`, for every continuation of non-zero probability."""
    st = SamplingTensors.build([params], [0], "cpu")
    joint = {(): 1.0}
    for _length in range(tokens):
        prefixes = list(joint)
        ids = torch.tensor([prompt + list(p) for p in prefixes])
        b, s = ids.shape
        with torch.no_grad():
            hidden, _ = model(ids.flatten(), torch.arange(s).repeat(b), CausalAttention(b, s))
            logits = model.logits(hidden.view(b, s, -1)[:, -1])
        probs = process_logits(logits[:, None].double(), _rows(st, b), None, None)[:, 0]
        joint = {
            p + (t,): joint[p] * probs[i, t].item()
            for i, p in enumerate(prefixes)
            for t in probs[i].nonzero()[:, 0].tolist()
        }
    return joint


def _rows(st: SamplingTensors, b: int) -> SamplingTensors:
    fields = {f: getattr(st, f) for f in st.__dataclass_fields__}
    return SamplingTensors(
        **{f: v.expand(b) if isinstance(v, torch.Tensor) else v for f, v in fields.items()}
    )


def chi_square_p_value(observed: dict, expected: dict, n: int) -> float:
    """Pearson's test, outcomes with expected count below 5 pooled into one bin (with
    every observed outcome `expected` does not list: probability 0)."""
    stat, pooled_e, bins = 0.0, 0.0, 0
    pooled_o = sum(o for outcome, o in observed.items() if outcome not in expected)
    for outcome, p in expected.items():
        e, o = p * n, observed.get(outcome, 0)
        if e < 5:
            pooled_o, pooled_e = pooled_o + o, pooled_e + e
            continue
        stat += (o - e) ** 2 / e
        bins += 1
    if pooled_e > 0:
        stat += (pooled_o - pooled_e) ** 2 / pooled_e
        bins += 1
    dof = bins - 1
    # Wilson-Hilferty: (X/dof)^(1/3) is close to normal with mean 1 - 2/(9 dof)
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def shifted_law(expected: dict, fraction: float, vocab: int = VOCAB) -> dict:
    """`expected` with `fraction` of the probability moved from the likeliest first token's
    outcomes to the next token id's (the alternative a law test must be able to reject)."""
    masses: dict[int, float] = {}
    for k, p in expected.items():
        masses[k[0]] = masses.get(k[0], 0.0) + p
    first = max(masses, key=masses.__getitem__)
    shifted = dict(expected)
    for k, p in expected.items():
        if k[0] == first:
            moved = ((first + 1) % vocab, *k[1:])
            shifted[k] -= p * fraction / masses[first]
            shifted[moved] = shifted.get(moved, 0) + p * fraction / masses[first]
    return shifted


# The shift the law tests reject to show their power: against a 2% shift, N = 3,000 draws gave
# p = 0.004-0.07 in the seven law tests here (too weak to rely on); against 4%, p < 3e-6.
POWER_SHIFT = 0.04


def assert_law(observed: dict, expected: dict, n: int) -> None:
    """The draws follow `expected` (p > 1e-3), and reject the shifted law (p < 1e-3)."""
    p = chi_square_p_value(observed, expected, n)
    assert p > 1e-3, f"p = {p:.2g} against the exact law"
    power = chi_square_p_value(observed, shifted_law(expected, POWER_SHIFT), n)
    assert power < 1e-3, f"p = {power:.2g} against a {POWER_SHIFT:.0%} shift: too weak a test"
