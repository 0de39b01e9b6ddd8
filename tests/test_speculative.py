"""Speculative decoding end to end: lossless greedy output, and pages after aborts."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools

import pytest

from core.params import SamplingParams
from core.step import CatchUp
from engine.planner import Planner
from models.eagle import save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import random_eagle_head, random_mtp_head

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def prompts():
    # repeats make the n-gram drafter find matches
    return [p + p[:5] for p in ragged_prompts(16, 300, seed=11)]


@pytest.fixture(scope="module")
def expected(tiny_target, prompts):
    async def plain():
        async with running(make_config(tiny_target)) as engine:
            return await staggered(engine, prompts, GREEDY)

    return asyncio.run(plain())


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix"])
@pytest.mark.parametrize("pages", [256, 40])
async def test_greedy_speculation_equals_plain(
    tiny_target, tiny_draft, prompts, expected, method, pages
):
    config = make_config(tiny_target, method, tiny_draft, k=3, pages=pages, max_batch_tokens=64)
    async with running(config) as engine:
        assert await staggered(engine, prompts, GREEDY, seed=5) == expected
        if pages < 100:
            assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.fixture(scope="module")
def heads(tiny_target, tmp_path_factory):
    """An EAGLE and an MTP head of the tiny target's shape (random)."""
    target = load_model(tiny_target)
    eagle, mtp = tmp_path_factory.mktemp("eagle"), tmp_path_factory.mktemp("mtp")
    save_eagle_head(random_eagle_head(target, norms=False), eagle)
    save_mtp_head(random_mtp_head(target, seed=7), mtp)
    return {"eagle": eagle, "mtp": mtp}


@pytest.fixture(scope="module")
def plain_outputs():
    """Greedy plain decoding of each quantized form, computed once."""
    return {}


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "eagle", "mtp"])
@pytest.mark.parametrize("weights", ["int8", "file"])
async def test_greedy_speculation_on_quantized_weights_equals_their_plain_decoding(
    tiny_target, tiny_quant_target, tiny_draft, heads, prompts, plain_outputs, method, weights
):
    """Quantized weights change the model (both sides are its quantized forwards), not the
    losslessness: --weights int8, and a GGUF file of mixed block types served at them."""
    target, kw = (
        (tiny_target, {"weights": "int8"}) if weights == "int8" else (tiny_quant_target, {})
    )
    if weights not in plain_outputs:
        async with running(make_config(target, **kw)) as engine:
            plain_outputs[weights] = await staggered(engine, prompts[:8], GREEDY)
    draft = tiny_draft if method == "draft" else heads.get(method)
    async with running(make_config(target, method, draft, k=3, **kw)) as engine:
        assert await staggered(engine, prompts[:8], GREEDY, seed=5) == plain_outputs[weights]


async def test_draft_model_accepts_its_own_output(tiny_target):
    """The target drafting for itself is always right: every draft token is accepted."""
    config = make_config(tiny_target, "draft", tiny_target, k=4)
    async with running(config) as engine:
        engine.tracer.keep(1000)
        deltas = await engine.generate([3, 4, 5], GREEDY)
    usage = deltas[-1].usage
    assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens
    # the timeline's refill widths: none after the prefill (token 1); after each step that
    # accepted all 4 drafts (tokens 2-21), the last draft, never fed to the drafter, and the
    # emitted token; the last step may draft only 2 (24 tokens in all), so it feeds the emitted one
    refills = [r["drafter_tokens"] for r in engine.tracer.records if r["stage"] == "refill"]
    assert refills == [0, 2, 2, 2, 2, 1]


@pytest.mark.parametrize("budget", [512, 60], ids=["whole", "in-chunks"])
async def test_a_draft_model_catches_up_exactly_after_steps_without_drafts(
    tiny_target, prompts, monkeypatch, budget
):
    """The target drafting for itself, its prefill deferred, drafting nothing five steps in
    seven (as the cost model's k = 0): those steps run no draft-model forward; the next step
    that drafts first runs it over the tokens it lacks (the prompt, the skipped steps' tokens),
    within the step's token budget: with a budget of 60 tokens (10 a row in a batch of six)
    in chunks over several steps, drafting nothing until a row has caught up. Every draft is
    still accepted, in a batch of rows that missed different numbers of tokens too, and the
    output equals plain decoding."""
    plain = await one_by_one(tiny_target, prompts[:6])
    calls = itertools.count()
    pattern = lambda self, seqs: 0 if next(calls) % 7 < 5 else 4  # noqa: E731
    monkeypatch.setattr(Planner, "_draft_length", pattern)
    steps: list[tuple[int, bool, CatchUp | None]] = []  # each step's (k, refill, catch-up)

    def watch(stage, plan, dev):
        if stage == "verify" and plan.kind == "decode":
            steps.append((plan.k, plan.drafter_refill, plan.catch_up))

    config = make_config(
        tiny_target, "draft", tiny_target, k=4, fault=watch, max_batch_tokens=budget
    )
    async with running(config) as engine:
        alone = await engine.generate(prompts[0], GREEDY)
        together = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts[:6]))
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert [token_ids(d) for d in together] == plain
    for deltas in [alone, *together]:
        usage = deltas[-1].usage
        assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens
    assert all(refill == (k > 0 or c is not None) for k, refill, c in steps)
    assert sum(k > 0 and c is not None for k, _, c in steps) >= 3  # caught up to draft
    assert not any(refill for k, refill, c in steps if c is None and k == 0)
    lengths = [c.length for _, _, c in steps if c is not None]
    assert max(lengths) <= budget
    if budget == 60:  # six rows' prompts are longer than 10 tokens: caught up in chunks
        assert any(lack is not None for _, _, c in steps if c is not None for lack in c.lacking)


async def one_by_one(target, prompts) -> list[list[int]]:
    async with running(make_config(target)) as engine:
        return [token_ids(await engine.generate(p, GREEDY)) for p in prompts]


async def test_per_request_k_and_max_tokens_are_respected(tiny_target, tiny_draft):
    config = make_config(tiny_target, "draft", tiny_target, k=4)
    async with running(config) as engine:
        for max_tokens in (1, 2, 3, 7):
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            assert len(token_ids(await engine.generate([3, 4], params))) == max_tokens
        params = SamplingParams(
            max_tokens=12, temperature=0, ignore_eos=True, num_speculative_tokens=1
        )
        usage = (await engine.generate([3, 4], params))[-1].usage
        assert usage.draft_tokens <= usage.spec_steps


async def test_aborts_mid_speculation_free_every_page(tiny_target, tiny_draft):
    config = make_config(tiny_target, "draft", tiny_draft, k=3, pages=64)
    async with running(config) as engine:
        params = SamplingParams(max_tokens=40, temperature=0.8)
        streams = [engine.submit(p, params) for p in ragged_prompts(8, 300, seed=3)]
        for stream in streams[::2]:
            async for delta in stream:
                if len(delta.token_ids):
                    engine.abort(stream.request_id)
        for stream in streams[1::2]:
            _ = [d async for d in stream]
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_greedy_speculation_with_logit_bias_equals_plain(tiny_target, tiny_draft, prompts):
    """The bias is applied to the target's p and to the drafter's q alike: output with
    speculation equals plain decoding's with the same bias, which differs from unbiased."""
    bias = tuple((t, 4.0) for t in range(40, 60)) + ((66, -100.0),)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logit_bias=bias)
    async with running(make_config(tiny_target)) as engine:
        plain = await staggered(engine, prompts[:6], params)
        unbiased = await staggered(engine, prompts[:6], GREEDY)
    assert plain != unbiased and all(66 not in out for out in plain)
    config = make_config(tiny_target, "draft", tiny_draft, k=3)
    async with running(config) as engine:
        assert await staggered(engine, prompts[:6], params, seed=5) == plain
    # the target drafting for itself, biased alike, is always right
    async with running(make_config(tiny_target, "draft", tiny_target, k=3)) as engine:
        usage = (await engine.generate(prompts[0], params))[-1].usage
    assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens


async def test_usage_counts_only_the_requests_own_speculation(tiny_target, tiny_draft):
    """A request with a draft cap of 0 verifies no drafts of its own, whatever its batch-mates
    draft: its usage says 0 steps."""
    async with running(make_config(tiny_target, "draft", tiny_draft, k=3)) as engine:
        capped = dataclasses.replace(GREEDY, num_speculative_tokens=0)
        alone, drafting = await asyncio.gather(
            engine.generate([3, 4, 5], capped), engine.generate([6, 7, 8], GREEDY)
        )
    assert alone[-1].usage.spec_steps == 0 and alone[-1].usage.draft_tokens == 0
    assert drafting[-1].usage.spec_steps > 0


@pytest.mark.parametrize("method", ["draft", "ngram", "suffix", "eagle", "mtp"])
async def test_greedy_fill_in_the_middle_equals_plain(tiny_target, tiny_draft, heads, method):
    """Code completion's prompts (prefix, suffix, then the middle to fill: api.py
    fill_in_the_middle) under every drafter: the plain decoding's tokens."""
    texts = [("def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"), ("class Point:\n", "\n")]
    async with running(make_config(tiny_target)) as engine:
        start, middle, end = engine.tokenizer.fim_ids
        enc = lambda text: engine.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        prompts = [[start, *enc(a), middle, *enc(b), end] for a, b in texts]
        want = await staggered(engine, prompts, GREEDY)
    draft = tiny_draft if method == "draft" else heads.get(method)
    async with running(make_config(tiny_target, method, draft, k=3)) as engine:
        assert await staggered(engine, prompts, GREEDY, seed=5) == want
