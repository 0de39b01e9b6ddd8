"""--batch-invariant: a row's result depends on nothing but its own tokens, so greedy output
equals plain decoding with no near-tie exception, and seeded sampling is the same bit for bit,
on a model built to have near-ties at almost every step (tests/tiny.py:write_near_tie_model).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from core.params import SamplingParams
from models.attention import InvariantAttention, TorchPagedAttention
from models.eagle import save_eagle_head
from models.llama import prepare_for_inference
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.paged import PagedRunner
from tests.tiny import random_eagle_head, random_mtp_head, write_model, write_near_tie_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=24, temperature=1.0, top_p=0.9, ignore_eos=True, seed=3)
# name: (method, the drafter's directory in `near_tie`, k, more SpecConfig fields)
DRAFTERS = {
    "draft": ("draft", "draft", 3, {}),
    "ngram": ("ngram", None, 3, {}),
    "suffix": ("suffix", None, 3, {}),
    "eagle-chain": ("eagle", "eagle", 3, {}),
    "eagle-fixed": ("eagle", "eagle", 3, {"tree": "fixed"}),
    "eagle-dynamic": ("eagle", "eagle", 3, {"tree": "dynamic"}),
    "mtp-1": ("mtp", "mtp", 1, {}),
    "mtp-k": ("mtp", "mtp", 3, {}),
    "hybrid": ("hybrid", "eagle", 3, {"hybrid_min_score": 0.5}),
}


@pytest.fixture(scope="module")
def near_tie(tmp_path_factory):
    """(target, {drafter kind: directory}) with a near-tie target."""
    root = tmp_path_factory.mktemp("near_tie")
    target = write_near_tie_model(root / "t")
    model = load_model(target)
    save_eagle_head(random_eagle_head(model, norms=True), root / "eagle")
    save_mtp_head(random_mtp_head(model, seed=7), root / "mtp")
    drafts = {"draft": write_model(root / "d", layers=1, hidden=32, seed=1)}
    return target, drafts | {"eagle": root / "eagle", "mtp": root / "mtp"}


def config(target, method="none", draft=None, invariant=True, k=3, pages=256, **spec):
    base = make_config(target, method, draft, k=k, pages=pages, spec_kw=spec or None)
    return dataclasses.replace(base, batch_invariant=invariant)


@pytest.fixture(scope="module")
def prompts():
    return ragged_prompts(16, 300, seed=11)


@pytest.fixture(scope="module")
def plain(near_tie, prompts):
    import asyncio

    async def run(params):
        async with running(config(near_tie[0])) as engine:
            return await staggered(engine, prompts, params)

    return {"greedy": asyncio.run(run(GREEDY)), "seeded": asyncio.run(run(SEEDED))}


async def test_the_default_kernels_flip_this_models_near_ties(
    near_tie, prompts, plain, monkeypatch
):
    """Without the mode the same check fails: the model's ties are real. (The native
    attention kernel gives a query the same result in any batch, so this shows on the SDPA
    path; the default kernels still round a one-row product and a prefill chunk's attention
    apart from a verify's.)"""
    monkeypatch.setattr(TorchPagedAttention, "native_max_q", 0)
    target, drafts = near_tie
    async with running(config(target, invariant=False)) as engine:
        default_plain = await staggered(engine, prompts, GREEDY)
    async with running(config(target, "draft", drafts["draft"], invariant=False)) as engine:
        speculative = await staggered(engine, prompts, GREEDY, seed=5)
    assert sum(a != b for a, b in zip(default_plain, speculative, strict=True)) > 0


@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
async def test_greedy_and_seeded_output_equal_plain_decoding_exactly(
    near_tie, prompts, plain, drafter
):
    target, drafts = near_tie
    method, kind, k, spec = DRAFTERS[drafter]
    cfg = config(target, method, drafts.get(kind) if kind else None, k=k, **spec)
    async with running(cfg) as engine:
        alone = token_ids(await engine.generate(prompts[3], SEEDED))
        assert alone == plain["seeded"][3]  # alone, and in the batch next
        assert await staggered(engine, prompts, GREEDY, seed=5) == plain["greedy"]
        assert await staggered(engine, prompts, SEEDED, seed=6) == plain["seeded"]
    # few pages: preemption recomputes requests from their tokens, in other chunks
    few_pages = dataclasses.replace(cfg, kv=dataclasses.replace(cfg.kv, num_pages=64))
    async with running(few_pages) as engine:
        assert await staggered(engine, prompts, SEEDED, seed=7) == plain["seeded"]
        assert engine.scheduler.num_preemptions > 0


def test_a_rows_logits_are_the_same_bits_however_it_is_batched(near_tie):
    """Full prefill, chunked prefill, a one-token decode, a row of a 4-row verify, and each of
    those batched with other sequences: the last prompt token's logits, bit for bit."""
    model = load_model(near_tie[0])
    prepare_for_inference(model, batch_invariant=True)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(1, 300, (37,), generator=g).tolist()
    others = [torch.randint(1, 300, (n,), generator=g).tolist() for n in (5, 70, 12)]

    def runner(n: int) -> PagedRunner:
        return PagedRunner(model, n, num_pages=160, attention=InvariantAttention)

    got = [runner(1).step([prompt])[0][-1]]
    chunked = runner(1)
    chunked.step([prompt[:20]])
    got.append(chunked.step([prompt[20:]])[0][-1])
    decode = runner(4)
    decode.step([prompt[:-1], *others])
    got.append(decode.step([prompt[-1:], [1], [2, 3], [4]])[0][-1])
    verify = runner(1)
    verify.step([prompt[:-3]])
    got.append(verify.step([prompt[-3:] + [5]])[0][-2])
    got.append(runner(4).step([prompt, *others])[0][-1])
    assert all(torch.equal(g, got[0]) for g in got[1:])
