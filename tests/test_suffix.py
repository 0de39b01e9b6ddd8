"""Suffix decoding: its trees and drafts against brute force on random strings, and through the
engine greedy equality with plain decoding and the sampled law (chi-square)."""

from __future__ import annotations

import asyncio
import random

import pytest

from core.params import SamplingParams
from core.request import FinishReason, Request
from stages.suffix import Cursor, SuffixDrafter, SuffixTree
from tests.engine_util import make_config, running, staggered, token_ids
from tests.stats import PARAMS, PROMPT, VOCAB, N, assert_law, exact_joint
from tests.tiny import write_model

DEPTH = 6


def occurrences(texts: list[list[int]], s: list[int]) -> int:
    return sum(text[i : i + len(s)] == s for text in texts for i in range(len(text) - len(s) + 1))


def substrings(texts: list[list[int]], depth: int) -> set[tuple[int, ...]]:
    return {
        tuple(text[i : i + n]) for text in texts for n in range(1, depth + 1)
        for i in range(len(text) - n + 1)
    }  # fmt: skip


def reference_draft(texts, context, k, min_prob, factor, depth):
    """Suffix decoding's draft by counting occurrences in the texts directly: the best-scoring
    of the drafts below each suffix of the context found in them (a tie: the longer match)."""
    context = context[-depth:]
    best: tuple[list[int], float] = ([], 0.0)
    for p in range(1, len(context)):
        path = context[-p:]
        if not occurrences(texts, path):
            break
        tokens, score, prob = [], 0.0, 1.0
        while len(tokens) < min(k, int(p * factor + 1e-6)) and len(path) < depth:
            counts = {t: occurrences(texts, path + [t]) for t in range(VOCAB_SMALL)}
            token = max(counts, key=lambda t: (counts[t], -t))
            if counts[token] == 0:
                break
            prob *= counts[token] / occurrences(texts, path)
            if prob < min_prob:
                break
            tokens.append(token)
            score += prob
            path = path + [token]
        if score >= best[1]:
            best = (tokens, score)
    return best


VOCAB_SMALL = 3


@pytest.mark.parametrize("seed", range(5))
def test_a_context_tree_counts_every_substring_as_it_grows(seed):
    rng = random.Random(seed)
    ids = [rng.randrange(VOCAB_SMALL) for _ in range(40)]
    context = Cursor(SuffixTree(DEPTH))
    for end in (1, 7, 8, 23, 40):  # grown a few tokens at a time
        context.extend(ids[:end])
        text = ids[:end]
        for s in substrings([text], DEPTH):
            node = context.tree.find(list(s))
            assert node is not None and context.tree.counts[node] == occurrences([text], list(s))
        # its active nodes are those of the context's suffixes, longest first
        for i, node in enumerate(context.active):
            assert node == context.tree.find(text[i + max(0, end - DEPTH) :])


@pytest.mark.parametrize("seed", range(5))
def test_the_global_tree_counts_the_texts_it_holds_after_removals(seed):
    rng = random.Random(seed)
    texts = [[rng.randrange(VOCAB_SMALL) for _ in range(rng.randrange(1, 20))] for _ in range(8)]
    tree = SuffixTree(DEPTH)
    for text in texts:
        Cursor(tree).extend(text)
    for text in texts[:3]:
        tree.remove(text)
    kept = texts[3:]
    for s in substrings(texts, DEPTH):
        node = tree.find(list(s))
        count = occurrences(kept, list(s))
        assert (tree.counts[node] if node is not None else 0) == count
    # a removed text's nodes are freed, its subtrees' too, and their numbers reused
    live = len(tree.counts) - len(tree.free)
    assert live == 1 + len(set(substrings(kept, DEPTH)))
    allocated = len(tree.counts)
    Cursor(tree).extend(texts[0])  # it was there before: its nodes fit in the freed ones
    assert len(tree.counts) == allocated


@pytest.mark.parametrize("seed", range(20))
def test_drafts_are_the_brute_force_ones(seed):
    """The drafter's proposal: the better-scoring (the request's own on a tie) of its own
    tree's draft and the global tree's (finished requests' outputs and its own so far), each
    as brute-force counting of occurrences gives it."""
    rng = random.Random(seed)
    drafter = SuffixDrafter(depth=DEPTH, min_prob=0.2, spec_factor=1.5)
    earlier = []
    for i in range(3):  # finished requests: their outputs stay in the global tree
        done = Request(f"old{i}", [0], SamplingParams(max_tokens=30), 0, 0.0)
        done.output_ids = [rng.randrange(VOCAB_SMALL) for _ in range(rng.randrange(5, 30))]
        drafter.propose_for(done, 4)
        done.finish_reason = FinishReason.STOP
        earlier.append(done.output_ids)
    drafter.host_drafts([], 4)  # retires them
    assert not drafter.running
    prompt = [rng.randrange(VOCAB_SMALL) for _ in range(12)]
    request = Request("now", prompt, SamplingParams(), 0, 0.0)
    for _ in range(6):
        ids = request.all_ids
        own = reference_draft([ids], ids, 4, 0.2, 1.5, DEPTH)
        shared = reference_draft(earlier + [request.output_ids], ids, 4, 0.2, 1.5, DEPTH)
        draft, want = drafter.propose_for(request, 4), own if own[1] >= shared[1] else shared
        assert draft.tokens == want[0] and draft.score == pytest.approx(want[1])
        request.output_ids += [rng.randrange(VOCAB_SMALL) for _ in range(rng.randrange(1, 4))]


def test_the_global_tree_keeps_a_bounded_number_of_tokens():
    drafter = SuffixDrafter(depth=DEPTH, max_tokens=10)
    for i in range(5):
        done = Request(f"r{i}", [1], SamplingParams(), 0, 0.0)
        done.output_ids = [i] * 4
        drafter.propose_for(done, 2)
        done.finish_reason = FinishReason.STOP
        drafter.host_drafts([], 2)
    assert drafter.kept_tokens == 8 and [o[0] for o in drafter.kept] == [3, 4]
    outputs = drafter.outputs
    assert outputs.find([0]) is None and outputs.counts[outputs.find([4, 4])] == 3


# ---------------------------------------------------------------- through the engine

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


async def test_greedy_suffix_decoding_equals_plain(tiny_target, plain16, ragged16):
    async with running(make_config(tiny_target, "suffix", k=4, max_batch_tokens=64)) as engine:
        assert await staggered(engine, ragged16, GREEDY, seed=5) == plain16
        # a second pass: the first pass's outputs are in the global tree now
        assert await staggered(engine, ragged16, GREEDY, seed=6) == plain16
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
        assert engine.metrics.registry.value("tandem_spec_decode_num_accepted_tokens_total") > 0


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_sampled_suffix_decoding_follows_the_target(tmp_path):
    """Requests in waves, so that later ones draft from earlier ones' outputs (the global
    tree) as well as from their own context."""
    target = write_model(tmp_path / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=VOCAB)
    config = make_config(
        target, "suffix", k=3, pages=1024, max_running=200, max_waiting=N, max_model_len=16
    )

    async def draws():
        async with running(config) as engine:
            outs = await asyncio.gather(
                *(engine.generate(PROMPT, SamplingParams(**PARAMS)) for _ in range(N))
            )
        assert sum(out[-1].usage.accepted_tokens for out in outs) > N // 2
        counts: dict[tuple[int, ...], int] = {}
        for out in outs:
            key = tuple(token_ids(out))
            counts[key] = counts.get(key, 0) + 1
        return counts

    assert_law(asyncio.run(draws()), exact_joint(target), N)
