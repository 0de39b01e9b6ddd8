"""--speculative auto (stages/policy.py): each request drafts with whatever its own measured
acceptance and the drafters' prices say pays. On the host, step by step against a scripted
target: a request that copies its prompt drafts with a free drafter, turns to the model when
the text turns new, drops a drafter at zero acceptance within a few steps and tries it again
later. Through the engine: greedy output equals plain decoding's (also in tests/test_matrix.py)
and usage and /metrics say which drafter drafted what."""

from __future__ import annotations

import asyncio
import dataclasses
import random

from core.params import SamplingParams
from core.request import PRIOR_RATE, Request
from engine.scheduler import Scheduler
from kv.pages import PageAllocator
from stages.draft import NoDrafter
from stages.policy import NONE, TRY_MODEL_STEPS, PolicyDrafter, Prices
from stages.suffix import SuffixDrafter
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids

# a step of rows each verifying n + 1 positions costs 1 + 0.1 n a row; each model draft 0.05 more
PRICES = Prices(
    batch=lambda rows, width, load: 0.9 * rows + 0.1 * rows * (width + 1),
    model=lambda k, load: 1 + 0.15 * k,
    catch_up=lambda n: 0.0,
)
K = 4
MODEL = "draft"  # the rows the draft model drafts are named by what it is


class NoModel:
    """Stands for a model drafter on the host: the policy only asks for its capabilities."""

    target_layers: tuple[int, ...] = ()
    leader_only = False
    lazy_refill = True


def policy() -> PolicyDrafter:
    return PolicyDrafter(NoModel(), MODEL, SuffixDrafter(), (1, 4), K, PRICES)  # type: ignore[arg-type]


def scheduler() -> Scheduler:
    return Scheduler(PageAllocator(8), 4, 4, 64, 5, 64)


class Script:
    """A request whose target emits `truth` token by token; the model's drafts are right with
    probability `model_rate` each; drafts are checked against the truth (greedy)."""

    def __init__(self, prompt: list[int], truth: list[int], model_rate: float):
        self.request = Request("r", prompt, SamplingParams(max_tokens=len(truth)), 0, 0.0)
        self.truth, self.model_rate = truth, model_rate
        self.rng = random.Random(0)

    def step(self, drafter: PolicyDrafter, sched: Scheduler, k: int = K) -> str:
        """One step (k: the cost model's choice for the model): the policy's choice, its
        drafts verified, the tokens committed; who drafted."""
        request, done = self.request, len(self.request.output_ids)
        (seq_drafts,) = drafter.host_drafts([FakeSeq(request)], k)
        (by,) = drafter.chosen or [NONE]
        ahead = self.truth[done:]
        if seq_drafts is None:  # the model's: right while the coin says so
            accepted = 0
            while accepted < min(K, len(ahead) - 1) and self.rng.random() < self.model_rate:
                accepted += 1
            drafted = K
        else:
            drafted = len(seq_drafts)
            accepted = next(
                (i for i, (d, t) in enumerate(zip(seq_drafts, ahead, strict=False)) if d != t),
                min(drafted, len(ahead)),
            )
        request.output_ids += ahead[: accepted + 1]
        sched.observe(request, drafted, accepted, by)
        return by


class FakeSeq:
    """A sequence whose draft model's KV is complete."""

    draft_from = None

    def __init__(self, request: Request):
        self.request = request
        self.num_tokens = request.num_tokens


def test_the_policy_turns_from_a_free_drafter_to_the_model_when_the_text_turns_new():
    rng = random.Random(1)
    copied = [rng.randrange(100, 300) for _ in range(60)]
    new = [rng.randrange(300, 500) for _ in range(80)]  # never seen: no lookup matches
    # the prompt ends where its own start began: its continuation is the prompt, copied
    script = Script(copied + copied[:2], copied[2:] + new, model_rate=0.7)
    drafter, sched = policy(), scheduler()
    choices = []
    while len(script.request.output_ids) < len(script.truth) - 1:
        choices.append((len(script.request.output_ids), script.step(drafter, sched)))
    # the model first, until its acceptance is measured; then the lookups while they copy
    assert [by for _, by in choices[:TRY_MODEL_STEPS]] == [MODEL] * TRY_MODEL_STEPS
    copying = [by for at, by in choices[TRY_MODEL_STEPS:] if at < len(copied) - 2 - K]
    fresh = [by for at, by in choices if at > len(copied) + 16]
    assert copying and all(by in ("ngram", "suffix") for by in copying), choices
    assert fresh and fresh.count(MODEL) >= 0.8 * len(fresh), choices


def test_a_drafter_at_zero_acceptance_is_dropped_within_a_few_steps_and_tried_again():
    """The model not drafting (the cost model's k = 0); the text repeats a pattern whose
    continuation never matches: the free drafters propose, nothing is accepted; the policy
    stops drafting within a few steps and, as the estimates fade back toward the prior, tries
    again."""
    rng = random.Random(2)
    pattern = [rng.randrange(100, 300) for _ in range(8)]
    truth = [rng.randrange(300, 500) if i % 2 else pattern[i % 8] for i in range(200)]
    script = Script(pattern * 4, truth, model_rate=0.0)
    drafter, sched = policy(), scheduler()
    choices = [script.step(drafter, sched, k=0) for _ in range(150)]
    drafted = [i for i, by in enumerate(choices) if by != NONE]
    assert drafted and drafted[0] < 3
    first_stop = next(i for i, by in enumerate(choices) if by == NONE)
    assert first_stop <= 6, choices  # dropped within a few steps
    assert any(i > first_stop + 5 for i in drafted), choices  # and tried again later


def test_a_new_request_starts_from_what_each_drafter_accepted_before():
    """The engine's own measure of each drafter is a new request's prior: after a request
    whose lookups mostly failed, the next one starts from what they accepted, and its
    estimate fades back to that, not to PRIOR_RATE; after one where the model accepted all,
    the next starts high; a fresh engine's request starts at PRIOR_RATE."""
    rng = random.Random(3)
    pattern = [rng.randrange(100, 300) for _ in range(8)]
    truth = [rng.randrange(300, 500) if i % 2 else pattern[i % 8] for i in range(120)]
    drafter, sched = policy(), scheduler()
    first = Script(pattern * 4, truth, model_rate=0.0)
    sched.add(first.request)
    for _ in range(60):
        first.step(drafter, sched, k=0)
    measured = sched.priors["ngram"].rate
    assert measured < PRIOR_RATE / 2
    second = Script(pattern * 4, truth, model_rate=0.0)
    sched.add(second.request)
    assert second.request.free_rates["ngram"].rate == measured
    for _ in range(40):  # the model drafting every step: the lookups' estimates fade
        sched.observe(second.request, K, K, MODEL)
    assert second.request.free_rates["ngram"].rate < (measured + PRIOR_RATE) / 2
    third = Script(pattern * 4, truth, model_rate=0.0)
    sched.add(third.request)  # the model accepted all it drafted for the second
    assert third.request.acceptance.rate > 0.9
    fresh = Script(pattern * 4, truth, model_rate=0.0)
    scheduler().add(fresh.request)
    assert fresh.request.free_rates["ngram"].rate == PRIOR_RATE


def test_leaving_a_caught_up_draft_model_prices_its_catch_up():
    """A lookup that would beat the model on the verify's price alone loses once the catch-up
    it leaves the draft model (a forward over the step's tokens, its refill skipped) is
    counted; where the draft model already lags, that forward is owed either way."""
    prices = dataclasses.replace(PRICES, catch_up=lambda n: 1.0)
    drafter = PolicyDrafter(NoModel(), MODEL, SuffixDrafter(), (1, 4), K, prices)  # type: ignore[arg-type]
    request = Request("r", [5, 6, 7, 8, 9] * 3, SamplingParams(max_tokens=64), 0, 0.0)
    request.acceptance.restart(0.8)
    request.acceptance.steps = TRY_MODEL_STEPS
    request.free_rates["ngram"].restart(0.9)
    request.free_rates["suffix"].restart(0.0)
    seq = FakeSeq(request)
    drafter.host_drafts([seq], K)  # type: ignore[list-item]
    assert drafter.chosen == [MODEL]
    seq.draft_from = request.num_tokens - 1  # lagging: the lookup's tokens cost it nothing more
    drafter.host_drafts([seq], K)  # type: ignore[list-item]
    assert drafter.chosen == ["ngram"]


def test_a_request_tries_the_model_first_unless_its_deferred_prefill_is_long():
    """A new request drafts with the model on its first steps where the model's catch-up (its
    deferred prefill of the prompt) costs no more than those steps; a long prompt's (fill in
    the middle) is left to the prices, which pick a lookup that copies the prompt."""
    prices = dataclasses.replace(PRICES, catch_up=lambda n: 0.02 * n)
    drafter = PolicyDrafter(NoModel(), MODEL, SuffixDrafter(), (1, 4), K, prices)  # type: ignore[arg-type]
    for length, first in ((20, MODEL), (1000, "ngram")):
        prompt = [5, 6, 7, 8, 9] * (length // 5)
        seq = FakeSeq(Request("r", prompt, SamplingParams(max_tokens=32), 0, 0.0))
        seq.draft_from = 0  # the prefill deferred: the draft model has none of the prompt
        drafter.host_drafts([seq], K)  # type: ignore[list-item]
        assert drafter.chosen == [first], length


def test_a_sampled_request_prices_its_rows_sampling():
    """A lookup that pays for a greedy request at 30% acceptance does not for a seeded sampled
    one, each of whose verified rows costs the sampler its coupling's noise too."""
    noise = lambda width, load: 0.3 * (width + 1) * load.coupled  # noqa: E731
    batch = lambda rows, width, load: PRICES.batch(rows, width, load) + noise(width, load)  # noqa: E731
    prices = dataclasses.replace(PRICES, batch=batch)
    drafter = PolicyDrafter(NoDrafter(), "none", SuffixDrafter(), (1, 4), K, prices)
    for params, chosen in (
        (SamplingParams(temperature=0), "ngram"),
        (SamplingParams(seed=1), NONE),
    ):
        request = Request("r", [5, 6, 7, 8, 9] * 3, params, 0, 0.0)
        request.free_rates["ngram"].restart(0.3)
        request.free_rates["suffix"].restart(0.0)
        drafter.host_drafts([FakeSeq(request)], 0)  # type: ignore[list-item]
        assert drafter.chosen == [chosen]


def test_a_batch_drafts_only_as_wide_as_pays_for_all_its_rows():
    """Every row verifies as many positions as the widest: a lookup at 30% that pays for its
    request alone does not pay for 15 other rows padded to its width; rows that copy their
    prompt (all accepted before) still do. Where the model drafts, the width is its k."""

    def request(prompt: list[int], rate: float) -> FakeSeq:
        r = Request("r", prompt, SamplingParams(temperature=0, max_tokens=64), 0, 0.0)
        r.free_rates["ngram"].restart(rate)
        r.free_rates["suffix"].restart(0.0)
        return FakeSeq(r)

    drafter = PolicyDrafter(NoDrafter(), "none", SuffixDrafter(), (1, 4), K, PRICES)
    lookup, fresh = [5, 6, 7, 8, 9] * 3, [1, 2, 3]  # n-gram proposes for one, not the other
    assert drafter.host_drafts([request(lookup, 0.3)], 0) == [[5]]
    batch = [request(lookup, 0.3)] + [request(fresh, 0.3) for _ in range(15)]
    assert drafter.host_drafts(batch, 0) == [[]] * 16  # type: ignore[arg-type]
    assert drafter.chosen == [NONE] * 16
    copying = [request(lookup, 0.99) for _ in range(16)]
    assert drafter.host_drafts(copying, 0) == [[5, 6, 7, 8]] * 16  # type: ignore[arg-type]
    model = PolicyDrafter(NoModel(), MODEL, SuffixDrafter(), (1, 4), K, PRICES)  # type: ignore[arg-type]
    pair = [request(lookup, 0.99), request(fresh, 0.0)]
    pair[0].request.acceptance.restart(0.0)
    pair[1].request.acceptance.restart(0.9)
    for seq in pair:
        seq.request.acceptance.steps = TRY_MODEL_STEPS
    assert model.host_drafts(pair, 2) == [[5, 6], None]  # type: ignore[arg-type]


def test_with_no_model_the_free_drafters_alone_are_weighed():
    """A target with no draft model or head: the cost model's k offers no model, so a row
    the lookups cannot help drafts nothing (a row of the model's would verify k empty drafts)."""
    drafter = PolicyDrafter(NoDrafter(), "none", SuffixDrafter(), (1, 4), K, PRICES)
    script = Script([5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15, 16], model_rate=0.0)
    sched = scheduler()
    choices = [script.step(drafter, sched) for _ in range(6)]
    assert choices == [NONE] * 6


def test_a_request_may_name_one_drafter():
    request = Request("r", [5, 6, 7, 5, 6], SamplingParams(speculative_method="ngram"), 0, 0.0)
    drafter = policy()
    assert drafter.host_drafts([FakeSeq(request)], K) == [[7, 5, 6]]  # type: ignore[list-item]
    assert drafter.chosen == ["ngram"]
    named = Request("r", [5, 6, 7, 5, 6], SamplingParams(speculative_method="none"), 0, 0.0)
    assert drafter.host_drafts([FakeSeq(named)], K) == [[]]  # type: ignore[list-item]


async def test_auto_is_lossless_and_says_who_drafted(tiny_target):
    """The tiny target drafting for itself as the model (its drafts all accepted, at a fixed k:
    priced by the cost model, a draft model as slow as the target never pays) beside the free
    drafters, against plain decoding: the same tokens; usage and /metrics count the drafts by
    drafter."""
    # repeats, where the lookups match, and text that does not repeat
    prompts = [p * 3 for p in ragged_prompts(3, 300, seed=4)] + ragged_prompts(3, 300, seed=5)
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    async with running(make_config(tiny_target)) as engine:
        plain = await staggered(engine, prompts, params)
    spec = {"adaptive_k": False, "hybrid_head": "draft"}
    config = make_config(tiny_target, "auto", tiny_target, k=4, spec_kw=spec)
    async with running(config) as engine:
        outs = [await engine.generate(p, params) for p in prompts]
        text = engine.metrics.render()
    assert [token_ids(o) for o in outs] == plain
    by_drafter: dict[str, list[int]] = {}
    for deltas in outs:
        for name, (drafted, accepted) in deltas[-1].usage.by_drafter.items():
            by_drafter.setdefault(name, [0, 0])
            by_drafter[name][0] += drafted
            by_drafter[name][1] += accepted
    assert MODEL in by_drafter  # its drafts (all accepted) pay the most
    for name, (drafted, _) in by_drafter.items():
        line = f'tandem_spec_decode_drafter_tokens_total{{drafter="{name}",kind="proposed"}}'
        assert f"{line} {float(drafted)}" in text


async def test_a_request_kept_off_the_draft_model_never_runs_it(tiny_target, monkeypatch):
    """The draft model costs nothing until it drafts: its prefill is deferred, so requests
    that draft with n-gram alone (or nothing) run no draft-model forward at all."""
    from stages.draft_model import DraftModelDrafter

    forwards = 0
    original = DraftModelDrafter.forward

    def counted(self, ids, positions, meta):
        nonlocal forwards
        forwards += 1
        return original(self, ids, positions, meta)

    monkeypatch.setattr(DraftModelDrafter, "forward", counted)
    spec = {"adaptive_k": False, "hybrid_head": "draft"}
    config = make_config(tiny_target, "auto", tiny_target, k=4, spec_kw=spec)
    async with running(config) as engine:
        for method in ("ngram", "none"):
            params = SamplingParams(
                max_tokens=16, temperature=0, ignore_eos=True, speculative_method=method
            )
            await asyncio.gather(*(engine.generate(p * 2, params) for p in ragged_prompts(4, 300)))
        assert forwards == 0
        await engine.generate(ragged_prompts(1, 300, seed=9)[0], SamplingParams(max_tokens=8))
        assert forwards > 0  # where it drafts, it runs


def test_a_catch_up_fits_the_step_budget_and_chunks_a_long_lag():
    """The draft model's catch-up (stages/draft_model.py catch_up_window): as long as the
    longest lag of the rows it drafts, within the budget a row; a longer lag in chunks."""
    from stages.draft_model import catch_up_window

    @dataclasses.dataclass
    class Lagging:
        num_tokens: int
        draft_from: int | None

    rows = [Lagging(20, 17), Lagging(30, None), Lagging(50, 10)]  # lags 3, 0, 40
    assert catch_up_window(rows, [False, True, False], 30) is None  # its row lacks nothing
    window = catch_up_window(rows, [True, True, True], 30)
    assert window is not None and window.length == 10  # 30 tokens over 3 rows
    assert window.end == [19, 29, 19] and window.lacking == [None, None, 20]
    whole = catch_up_window(rows, [True, False, False], 300)
    assert whole is not None and whole.length == 3 and whole.lacking == [None, None, 13]
