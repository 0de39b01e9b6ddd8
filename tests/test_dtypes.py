"""The whole engine in bfloat16 and float16 (what a GPU runs), on the CPU: for every drafter,
speculation equals no speculation in that dtype, and against float32 the output differs only
where float32's top two logits are within that dtype's rounding."""

from __future__ import annotations

import pytest

from engine.request import SamplingParams
from models.eagle import save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import random_eagle_head, random_mtp_head

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
# name: (method, the drafter's directory in `drafters`, k, more SpecConfig fields)
DRAFTERS = {
    "draft": ("draft", "target", 3, {}),  # the target drafting for itself: drafts accepted
    "ngram": ("ngram", None, 3, {}),
    "eagle": ("eagle", "eagle", 3, {}),
    "eagle-tree": ("eagle", "eagle", 3, {"tree": "dynamic"}),
    "mtp-k": ("mtp", "mtp", 3, {}),
    "mtp-1": ("mtp", "mtp", 1, {}),
}
# a logit gap float32 may lose in the dtype's rounding through the tiny model's two layers
ROUNDING = {"bfloat16": 0.25, "float16": 0.03}


@pytest.fixture(scope="module")
def drafters(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    model = load_model(tiny_target)
    save_eagle_head(random_eagle_head(model, norms=True), root / "eagle")
    save_mtp_head(random_mtp_head(model, seed=7), root / "mtp")
    return {"target": tiny_target, "eagle": root / "eagle", "mtp": root / "mtp"}


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(4, 300, seed=5)


async def generate(target, prompts, dtype, method="none", draft=None, k=3, **spec):
    """Greedy token ids of each prompt, staggered into one batch."""
    config = make_config(target, method, draft, k=k, dtype=dtype, spec_kw=spec or None)
    async with running(config) as engine:
        return await staggered(engine, prompts, GREEDY)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_speculation_equals_plain_decoding_in_the_dtype(
    tiny_target, drafters, prompts, dtype
):
    plain = await generate(tiny_target, prompts, dtype)
    assert all(len(out) == GREEDY.max_tokens for out in plain)
    for name, (method, draft, k, spec) in DRAFTERS.items():
        draft_dir = drafters[draft] if draft else None
        out = await generate(tiny_target, prompts, dtype, method, draft_dir, k, **spec)
        assert out == plain, name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_the_dtype_departs_from_float32_only_at_near_ties(tiny_target, prompts, dtype):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    async with running(make_config(tiny_target)) as engine:
        exact = [await engine.generate(p, params) for p in prompts]
    rounded = await generate(tiny_target, prompts, dtype)
    assert all(len(out) == GREEDY.max_tokens for out in rounded)
    for deltas, theirs in zip(exact, rounded, strict=True):
        ours = token_ids(deltas)
        first = next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=True)) if x != y), None)
        if first is not None:
            top = [lp for d in deltas for lp in d.logprobs][first].top
            assert top[0][1] - top[1][1] < ROUNDING[dtype], (first, top)
