"""Sampled speculation follows the target's distribution exactly (chi-square).

A target with a 6-token vocabulary, so the joint law of the first four generated tokens
(1,296 outcomes) can be computed exactly by enumerating prefixes. N requests run as one
batch: the first token comes from the prefill, the next three from speculative steps with
k = 2 (the first one drafting two tokens). Requests without a seed take the rejection rule
(sampled or argmax drafts); seeded ones the coupling. The test also checks its own power:
the same draws must reject a law with 2% of one first token's mass moved elsewhere.
"""

from __future__ import annotations

import asyncio

import pytest

from core.params import SamplingParams
from stages.policy import PolicyDrafter
from tests.engine_util import running, token_ids
from tests.stats import PARAMS, PROMPT, TOKENS, VOCAB, N, assert_law, exact_joint, law_config
from tests.tiny import write_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("stats")
    target = write_model(root / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=VOCAB)
    draft = write_model(root / "d", layers=1, hidden=16, seed=4, scale=1.5, model_vocab=VOCAB)
    return target, draft


async def sampled_joint(
    target, draft, sampled_drafts: bool, seeded: bool, draft_vocab: int = 0
) -> dict[tuple[int, ...], int]:
    spec_kw = {"sampled_drafts": sampled_drafts, "draft_vocab": draft_vocab}
    config = law_config(target, "draft", draft, spec_kw=spec_kw)
    async with running(config) as engine:
        outs = await asyncio.gather(
            *(
                engine.generate(PROMPT, SamplingParams(seed=i if seeded else None, **PARAMS))
                for i in range(N)
            )
        )
    counts: dict[tuple[int, ...], int] = {}
    # every request's first speculative step drafted two tokens
    assert all(out[-1].usage.draft_tokens >= 2 for out in outs)
    for out in outs:
        key = tuple(token_ids(out))
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "sampled_drafts, seeded, draft_vocab",
    [(True, False, 0), (False, False, 0), (True, True, 0), (True, False, 3), (True, True, 3)],
    ids=["rejection", "rejection-argmax-drafts", "coupling", "draft-vocab", "coupling-draft-vocab"],
)
@pytest.mark.slow
def test_sampled_speculation_follows_target(models, sampled_drafts, seeded, draft_vocab):
    """draft-vocab: the draft model's q over 3 of the 6 tokens, 0 on the others, which the
    target then emits from the residual alone."""
    target, draft = models
    expected = exact_joint(target)
    assert abs(sum(expected.values()) - 1) < 1e-5
    assert all(len(k) == TOKENS for k in expected)
    observed = asyncio.run(sampled_joint(target, draft, sampled_drafts, seeded, draft_vocab))
    assert sum(observed.values()) == N
    assert_law(observed, expected, N)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seeded", [False, True], ids=["rejection", "coupling"])
@pytest.mark.slow
def test_switching_drafters_within_a_request_follows_target(models, seeded, monkeypatch):
    """--speculative auto switching drafters within requests: n-gram lookup's point masses
    where the context repeats and the output so far has an even length, the draft model's
    sampled q otherwise (a rule of the test's, as deterministic in the past tokens as the
    policy's own, which tests/test_policy.py holds); the joint law is still the target's."""
    target, draft = models

    def alternate(self, seq, k, share):
        lookup = self.free_drafts(seq.request)["ngram"]()
        if len(seq.request.output_ids) % 2 == 0 and lookup:
            return "ngram", lookup
        return self.model_name, None

    monkeypatch.setattr(PolicyDrafter, "_choose", alternate)
    spec_kw = {"hybrid_head": "draft", "sampled_drafts": True}
    config = law_config(target, "auto", draft, spec_kw=spec_kw)

    async def run():
        async with running(config) as engine:
            return await asyncio.gather(
                *(
                    engine.generate(PROMPT, SamplingParams(seed=i if seeded else None, **PARAMS))
                    for i in range(N)
                )
            )

    outs = asyncio.run(run())
    switched = [o for o in outs if len(o[-1].usage.by_drafter) > 1]
    assert len(switched) > N // 10  # many requests drafted with both
    observed: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(token_ids(out))
        observed[key] = observed.get(key, 0) + 1
    assert_law(observed, exact_joint(target), N)
