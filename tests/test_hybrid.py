"""--speculative hybrid (suffix decoding where it expects to pay, a head or the draft model
elsewhere) and each
request's choice of drafter: greedy output equals plain decoding, with preemption and
requests choosing differently in one batch; the head's state follows the text whoever
drafted it; sampled output follows the target's law (chi-square)."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from core.params import InvalidRequest, SamplingParams
from core.step import CatchUp
from models.eagle import save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from stages.suffix import HybridDrafter
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.stats import PARAMS, PROMPT, VOCAB, N, assert_law, exact_joint, law_config
from tests.tiny import random_eagle_head, random_mtp_head, write_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def heads(tiny_target, tiny_draft, tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    model = load_model(tiny_target)
    save_eagle_head(random_eagle_head(model, norms=True), root / "eagle")
    save_mtp_head(random_mtp_head(model, seed=7), root / "mtp")
    return {"eagle": root / "eagle", "mtp": root / "mtp", "draft": tiny_draft}


@pytest.fixture(scope="module")
def prompts():
    # repeats give the suffix trees matches; the rest falls to the head
    return [p + p[:6] + p[:6] for p in ragged_prompts(12, 300, seed=13)]


@pytest.fixture(scope="module")
def expected(tiny_target, prompts):
    async def plain():
        async with running(make_config(tiny_target)) as engine:
            return await staggered(engine, prompts, GREEDY)

    return asyncio.run(plain())


def hybrid(target, head_dir, head="eagle", min_score=0.5, **kw):
    spec = {"hybrid_head": head, "hybrid_min_score": min_score}
    return make_config(target, "hybrid", head_dir, k=3, spec_kw=spec, **kw)


@pytest.mark.parametrize("head", ["eagle", "mtp", "draft"])
@pytest.mark.parametrize("pages", [256, 40])
async def test_greedy_hybrid_equals_plain(tiny_target, heads, prompts, expected, head, pages):
    config = hybrid(tiny_target, heads[head], head, pages=pages, max_batch_tokens=64)
    async with running(config) as engine:
        assert await staggered(engine, prompts, GREEDY, seed=5) == expected
        if pages < 100:
            assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_each_request_drafts_as_it_chose(tiny_target, heads, prompts, expected):
    """One batch, five choices: each output equals plain decoding; none drafts nothing;
    suffix alone drafts where its trees match; a drafter the server did not load is refused."""
    choices = [None, "hybrid", "suffix", "eagle", "none"]
    config = hybrid(tiny_target, heads["eagle"])
    async with running(config) as engine:
        runs = [
            engine.generate(p, dataclasses.replace(GREEDY, speculative_method=c))
            for p, c in zip(prompts, choices * 3, strict=False)
        ]
        outs = await asyncio.gather(*runs)
        with pytest.raises(InvalidRequest, match="speculative_method 'draft' is not loaded"):
            engine.submit([1, 2], SamplingParams(speculative_method="draft"))
    assert [token_ids(o) for o in outs] == expected[: len(outs)]
    chose = (choices * 3)[: len(outs)]
    drafted = {c: [o[-1].usage.draft_tokens for o, x in zip(outs, chose, strict=True) if x == c]
               for c in choices}  # fmt: skip
    assert drafted["none"] == [0, 0]
    assert all(n > 0 for c in ("hybrid", "suffix", "eagle") for n in drafted[c])


async def test_a_method_server_takes_its_own_name_and_none(tiny_target):
    async with running(make_config(tiny_target, "ngram")) as engine:
        for choice in ("ngram", "none"):
            params = SamplingParams(max_tokens=4, speculative_method=choice)
            assert len(token_ids(await engine.generate([5, 6, 5, 6], params))) == 4
        with pytest.raises(InvalidRequest, match="choose from none, ngram"):
            engine.submit([1], SamplingParams(speculative_method="suffix"))


async def test_the_draft_model_skips_the_suffix_steps_and_catches_up(tiny_target, heads, prompts):
    """With the draft model as the model half, a step the suffix drafts every row of skips
    the draft model's refill, and the next step it drafts in first runs it over the tokens it
    missed; the output is plain decoding's. One request at a time: a batch's every row is
    rarely the suffix's."""
    steps: list[tuple[bool, CatchUp | None]] = []  # each decode step's (refill, catch-up)

    def watch(stage, plan, dev):
        if stage == "verify" and plan.kind == "decode":
            steps.append((plan.drafter_refill, plan.catch_up))

    params = dataclasses.replace(GREEDY, max_tokens=48)

    async def serial(config):
        async with running(config) as engine:
            outs = [token_ids(await engine.generate(p, params)) for p in prompts[:4]]
            await engine.wait_idle()
            assert engine.allocator.num_free == engine.allocator.num_pages
            return outs

    plain = await serial(make_config(tiny_target))
    assert await serial(hybrid(tiny_target, heads["draft"], "draft", fault=watch)) == plain
    assert sum(not refill for refill, _ in steps) >= 3  # the suffix's steps
    assert sum(catch_up is not None for _, catch_up in steps) >= 2
    assert all(refill for refill, catch_up in steps if catch_up is not None)


@pytest.mark.parametrize("model", ["eagle", "draft"])
async def test_the_head_follows_the_text_whoever_drafted_it(tiny_target, heads, model, monkeypatch):
    """The head's (or draft model's) greedy drafts at a position depend on the text before it
    alone: the same with the suffix drafting some steps (hybrid) as with the model drafting
    every step (a step as wide as its suffix draft holds a prefix of them). A draft model
    drafts nothing in the suffix's steps (its refill skipped, then caught up): it is watched
    where it drafts."""
    seen: dict[str, dict[int, list[int]]] = {model: {}, "hybrid": {}}
    suffix_steps = []
    propose = HybridDrafter.propose

    def watched(self, plan, dev):
        suffix_steps.append(plan.fields["host_drafts"][0] >= 0)
        if plan.drafter_refill:
            drafts = self.head.propose(plan, dev)
            choice = plan.seqs[0].request.params.speculative_method
            seen[choice][int(dev.base[0])] = drafts.tokens[0].tolist()
        return propose(self, plan, dev)

    monkeypatch.setattr(HybridDrafter, "propose", watched)
    prompt = [7, 8, 9, 10, 11, 7, 8, 9, 10, 11, 7, 8]
    async with running(hybrid(tiny_target, heads[model], model, min_score=0.2)) as engine:
        for choice in seen:
            params = dataclasses.replace(GREEDY, max_tokens=64, speculative_method=choice)
            await engine.generate(prompt, params)
    assert sum(suffix_steps) >= 3
    common = seen[model].keys() & seen["hybrid"].keys()
    assert len(common) >= 8
    for p in common:
        ours, theirs = seen["hybrid"][p], seen[model][p]
        assert ours == theirs[: len(ours)], p


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("model", ["eagle", "draft"])
def test_sampled_hybrid_follows_the_target(tmp_path, model):
    """Rows of one batch drafting by the suffix (point masses) and by the head or the draft
    model (sampled q)."""
    target = write_model(tmp_path / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=VOCAB)
    if model == "eagle":
        head = random_eagle_head(load_model(target), norms=True, scale=1.5)
        save_eagle_head(head, tmp_path / "h")
    else:
        write_model(tmp_path / "h", layers=1, hidden=16, seed=4, scale=1.5, model_vocab=VOCAB)
    spec_kw = {"hybrid_min_score": 0.3, "hybrid_head": model}
    config = law_config(target, "hybrid", tmp_path / "h", spec_kw=spec_kw)
    choices = ["hybrid", "suffix", model]

    async def run():
        async with running(config) as engine:
            return await asyncio.gather(
                *(
                    engine.generate(
                        PROMPT, SamplingParams(speculative_method=choices[i % 3], **PARAMS)
                    )
                    for i in range(N)
                )
            )

    outs = asyncio.run(run())
    suffix = [o[-1].usage.draft_tokens > 0 for o in outs[1::3]]
    assert sum(suffix) > len(suffix) // 2  # the suffix drafted for most of its requests
    observed: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(token_ids(out))
        observed[key] = observed.get(key, 0) + 1
    assert_law(observed, exact_joint(target), N)


def test_hybrid_is_a_chain():
    from engine.config import SpecConfig

    with pytest.raises(ValueError, match="needs a head"):
        SpecConfig("hybrid", tree="dynamic")


async def test_the_suffix_drafts_where_the_cost_model_turns_the_head_off(
    tiny_target, heads, prompts, expected, monkeypatch
):
    """The cost model's k prices the head: at k = 0 the head's rows draft nothing, and the
    suffix still drafts up to --num-speculative-tokens."""
    from engine.planner import Planner

    monkeypatch.setattr(Planner, "_draft_length", lambda self, seqs: 0)
    async with running(hybrid(tiny_target, heads["eagle"])) as engine:
        outs = await asyncio.gather(
            *(
                engine.generate(p, dataclasses.replace(GREEDY, speculative_method=c))
                for p, c in zip(prompts[:6], ["suffix", "eagle"] * 3, strict=True)
            )
        )
    assert [token_ids(o) for o in outs] == expected[:6]
    drafted = [o[-1].usage.draft_tokens for o in outs]
    assert all(n > 0 for n in drafted[0::2]) and drafted[1::2] == [0, 0, 0]
