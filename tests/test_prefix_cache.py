"""Prefix caching: the index and the allocator under random admission, finishing, aborting,
preemption and eviction (no page leaked, freed while held, or found under tokens it does not
hold); and through the engine, output with cache hits equal to output without the cache, for
every drafter that keeps its state in cached pages, its drafts kept alike (batch-invariant:
a drafter whose state a hit lost would draft otherwise)."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest

from core.params import SamplingParams
from core.request import Request
from core.step import StepKind
from engine.scheduler import Scheduler
from kv.pages import OutOfPages, PageAllocator
from kv.prefix import PrefixIndex
from models.eagle import save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, token_ids
from tests.tiny import random_eagle_head, random_mtp_head

PAGE = 4


# ---------------------------------------------------------------- the index and the allocator


def test_a_prompt_finds_the_full_pages_of_its_longest_cached_prefix():
    index = PrefixIndex(PAGE)
    allocator = PageAllocator(8, index)
    pages = allocator.alloc(3)
    index.insert(list(range(11)), pages)  # 11 tokens: two full pages cached
    assert index.match(list(range(20)), 19) == pages[:2]
    assert index.match([0, 1, 2, 3, 4, 5, 9, 9, 9], 8) == pages[:1]  # differs in page 2
    assert index.match(list(range(8)), 7) == pages[:1]  # a hit leaves the last token out
    assert index.match([1, 2, 3, 4], 4) == []  # the same tokens at another place


def test_with_pairs_ahead_a_hit_ends_where_the_next_token_differs():
    """An EAGLE head keeps token p's pair at slot p - 1: a block's last slot holds the pair of
    the token after it in the sequence that wrote the page."""
    index = PrefixIndex(PAGE, pairs_ahead=True)
    pages = PageAllocator(8, index).alloc(3)
    index.insert(list(range(12)), pages)  # the third block's next token is not known yet
    assert index.match(list(range(9)) + [50], 9) == pages[:2]
    assert index.match(list(range(8)) + [50, 9], 9) == pages[:1]  # 8 follows the second
    assert index.match(list(range(13)), 12) == pages[:2]
    index.insert(list(range(13)), pages)  # now it is
    assert index.match(list(range(13)), 12) == pages


def test_idle_cached_pages_count_as_free_and_are_evicted_least_recently_used():
    index = PrefixIndex(PAGE)
    allocator = PageAllocator(4, index)
    a, b = allocator.alloc(2), allocator.alloc(2)
    index.insert(list(range(8)), a)
    index.insert(list(range(100, 108)), b)
    allocator.free(a)
    allocator.free(b, after_step=3)  # the device may still write b
    assert allocator.num_free == 2 and allocator.num_parked == 2
    allocator.release(3)
    assert allocator.num_free == 4 and len(index.idle) == 4
    allocator.share(index.match(list(range(100, 108)) + [0], 8))  # b used again: newest
    assert sorted(allocator.alloc(2)) == sorted(a)  # the idle pages evicted
    assert index.match(list(range(8)) + [0], 8) == []  # a was evicted
    with pytest.raises(OutOfPages):
        allocator.alloc(1)  # b is held


def test_a_page_a_hit_takes_while_parked_stays_held():
    index = PrefixIndex(PAGE)
    allocator = PageAllocator(2, index)
    pages = allocator.alloc(1)
    index.insert([1, 2, 3, 4], pages)
    allocator.free(pages, after_step=0)
    allocator.share(index.match([1, 2, 3, 4, 5], 4))
    allocator.release(0)
    assert not index.idle and allocator.num_free == 1


def request(name: str, ids: list[int], arrival: float, max_tokens: int) -> Request:
    return Request(name, ids, SamplingParams(max_tokens=max_tokens, temperature=0), 0, arrival)


@pytest.mark.parametrize("seed", range(6))
def test_random_traffic_never_shares_a_page_under_other_tokens_and_leaks_none(seed):
    """Requests with shared prefixes (and their outputs resent as prompts) are admitted,
    decode, finish, are aborted and preempted at random over a small pool. The KV each page
    holds is simulated (the token each slot was written with): a hit may only bring pages
    holding exactly the prompt's tokens, a held page is never handed out again, and once all
    requests are gone every page is free."""
    rng = random.Random(seed)
    index = PrefixIndex(PAGE)
    allocator = PageAllocator(24, index)
    s = Scheduler(
        allocator, PAGE, max_running=3, max_batch_tokens=12, lookahead=1, max_model_len=64
    )
    written: dict[int, int] = {}  # slot -> the token its KV was computed for
    roots = [[rng.randrange(5) for _ in range(rng.randrange(2, 14))] for _ in range(4)]
    finished: list[list[int]] = []
    arrivals = 0

    def token_at(req: Request, position: int) -> int:
        return req.all_ids[position]

    for step in range(300):
        if rng.random() < 0.4 and len(s.waiting) < 4:
            base = rng.choice(roots + finished) if finished else rng.choice(roots)
            ids = base + [rng.randrange(5) for _ in range(rng.randrange(0, 6))]
            s.add(request(f"r{arrivals}", ids or [1], float(arrivals), rng.randrange(1, 8)))
            arrivals += 1
        for seq in s.running:  # a hit's pages hold the tokens of the prompt
            for j in range(seq.num_cached):
                assert written[seq.table.slot(j)] == seq.prefill_ids[j]
        held = [p for seq in s.running for p in seq.table.pages]
        assert not set(held) & (set(allocator._free) | set(index.idle))
        batch = s.schedule(step)
        if batch is None:
            continue
        emits = [
            batch.kind == StepKind.DECODE or seq.num_prefilled + chunk == len(seq.prefill_ids)
            for seq, chunk in zip(batch.seqs, batch.chunks, strict=True)
        ]
        for seq, chunk in zip(batch.seqs, batch.chunks, strict=True):
            if batch.kind == StepKind.PREFILL:
                for p in range(seq.num_prefilled, seq.num_prefilled + chunk):
                    written[seq.table.slot(p)] = seq.prefill_ids[p]
            else:  # the last committed token's KV
                written[seq.table.slot(seq.num_tokens - 1)] = token_at(seq.request, -1)
        s.planned(batch, emits)
        for seq, emitting in zip(batch.seqs, emits, strict=True):
            if emitting:
                seq.request.output_ids.append(rng.randrange(5))
            s.landed(seq, emitting, int(emitting))
            done = len(seq.request.output_ids) >= seq.request.params.max_tokens
            if done or rng.random() < 0.05:  # finished, or aborted
                if done:
                    finished.append(seq.request.all_ids)
                s.finish(seq.request)
        s.allocator.release(step)
    for seq in list(s.running):
        s.finish(seq.request)
    s.waiting.clear()
    allocator.release(10**6)
    assert allocator.num_free == allocator.num_pages and index.hit > 0


# ---------------------------------------------------------------- through the engine

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
# penalties count the prompt's tokens: the cached ones must reach the token history too
PENALIZED = SamplingParams(max_tokens=12, temperature=0, repetition_penalty=3.0, ignore_eos=True)


def conversations(vocab: int = 300) -> list[list[int]]:
    """Prompts sharing prefixes: a base, the base extended (a hit that ends inside a page of
    the extension), the base again (a hit of every page short of the last token), the base's
    first two pages and then other tokens (a hit that ends where the next token differs from
    the one its pages were written with)."""
    bases = ragged_prompts(3, vocab, seed=3)
    turns = lambda b: (
        b + b[:3],
        b + b[:3] + [5, 6, 7, 8, 9, 10],
        b + b[:3],
        b[:8] + [b[8] ^ 1] * 3,
    )
    return [p for b in bases for p in turns(b)]


async def serial(engine, prompts, params):
    """Each prompt's tokens and its drafts' counts (drafted, accepted), one after another."""
    outs = []
    for prompt in prompts:
        deltas = await engine.generate(prompt, params)
        usage = deltas[-1].usage
        outs.append((token_ids(deltas), usage.draft_tokens, usage.accepted_tokens))
    return outs


@pytest.fixture(scope="module")
def heads(tiny_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("prefix_heads")
    target = load_model(tiny_target)
    save_mtp_head(random_mtp_head(target), root / "mtp")
    save_eagle_head(random_eagle_head(target, norms=True), root / "eagle")
    return root


DRAFTERS = {  # name: (method, the drafter's directory (None: tiny_draft), SpecConfig fields)
    "none": ("none", None, {}),
    "ngram": ("ngram", None, {}),
    "draft": ("draft", None, {}),
    "mtp": ("mtp", "mtp", {}),
    "mtp-tree": ("mtp", "mtp", {"tree": "fixed"}),
    "eagle": ("eagle", "eagle", {}),
    "eagle-tree": ("eagle", "eagle", {"tree": "dynamic"}),
    "suffix": ("suffix", None, {}),
    "hybrid": ("hybrid", "eagle", {"hybrid_head": "eagle", "hybrid_min_score": 0.5}),
    # the draft model skips the suffix's steps: pages it lacks the KV of are not cached
    "hybrid-draft": ("hybrid", None, {"hybrid_head": "draft", "hybrid_min_score": 0.5}),
}


@pytest.mark.parametrize("method", list(DRAFTERS))
@pytest.mark.parametrize(
    "params",
    [
        pytest.param(GREEDY, id="greedy"),
        pytest.param(SEEDED, id="seeded", marks=pytest.mark.slow),
        pytest.param(PENALIZED, id="penalized", marks=pytest.mark.slow),
    ],
)
def test_output_with_cache_hits_equals_output_without_the_cache(
    tiny_target, tiny_draft, heads, method, params
):
    kind, head, fields = DRAFTERS[method]
    draft = heads / head if head else tiny_draft

    async def run(cache: bool):
        config = make_config(tiny_target, kind, draft, batch_invariant=True, spec_kw=fields or None)
        config = dataclasses.replace(config, kv=dataclasses.replace(config.kv, prefix_cache=cache))
        async with running(config) as engine:
            drafted = spy_on_drafts(engine)
            prompts = conversations()
            outs = await serial(engine, prompts, params)
            # a second turn: the first turn's prompt and answer, and more
            outs += await serial(engine, [prompts[0] + outs[0][0] + [1, 2, 3]], params)
            await engine.wait_idle()
            assert engine.allocator.num_free == engine.allocator.num_pages
            prefixes = engine.allocator.prefixes
            return outs, drafted, (prefixes.hit if prefixes else 0)

    with_cache, drafted, hit = asyncio.run(run(True))
    without, drafted_without, _ = asyncio.run(run(False))
    assert hit > 0
    assert with_cache == without
    # the very same drafts: what the drafter needs came with the hit
    assert drafted == drafted_without


def spy_on_drafts(engine) -> list:
    """Every step's draft tokens, as the drafter proposed them."""
    drafted = []
    propose = engine.drafter.propose

    def spy(plan, dev):
        drafts = propose(plan, dev)
        drafted.append(drafts.tokens.tolist())
        return drafts

    engine.drafter.propose = spy
    return drafted


def test_a_block_says_whether_the_draft_models_kv_is_written():
    """A draft model that deferred its prefill: a hit knows where the draft model's own KV
    ends (and a page inserted again once that KV is written says so)."""
    index = PrefixIndex(4)
    index.insert(list(range(12)), [5, 6, 7], drafted=5)  # the draft's KV of tokens 0..4
    pages = index.match(list(range(13)), 12)
    assert pages == [5, 6, 7] and index.drafted_tokens(pages) == 4
    index.insert(list(range(12)), [5, 6, 7])
    assert index.drafted_tokens(pages) == 12
