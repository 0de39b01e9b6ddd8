"""EAGLE tree drafting: tree-masked verification against dense recomputes, the accepted path's
KV moves, lossless greedy and sampled speculation for chain, fixed and dynamic trees."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from core.params import SamplingParams
from engine.config import SpecConfig
from kv.cache import KVCache
from kv.table import PageTable
from models.attention import CausalAttention, TorchPagedAttention, paged_metadata
from models.eagle import save_eagle3_head, save_eagle_head
from models.loader import load_model
from models.mtp import save_mtp_head
from server import config_from_args
from stages import tree_drafter
from stages.draft import refill_columns
from stages.tree import move_tree_path, tree_ancestors, tree_drafts
from stages.tree_drafter import _best
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.paged import shuffled_allocator
from tests.stats import (
    PARAMS,
    PROMPT,
    TOKENS,
    VOCAB,
    N,
    assert_law,
    chi_square_pvalue,
    exact_joint,
)
from tests.tiny import random_eagle3_head, random_eagle_head, random_mtp_head, write_model

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
DRAWS = {"fixed": N, "dynamic": N}  # requests of the sampling-law tests
FIXED = ((0,), (1,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 0, 1), (0, 0, 0, 0))
TREES = {
    "chain": dict(tree="chain"),
    "fixed": dict(tree="fixed", tree_paths=FIXED),
    "dynamic": dict(tree="dynamic", tree_nodes=7, tree_depth=3, tree_topk=3),
}


def tree_config(target, head, tree: str, sampled_drafts: bool = True, method="eagle", **kw):
    """Every decode step drafts the whole tree (no cost model shrinking it)."""
    spec = TREES[tree] | {"adaptive_k": False, "sampled_drafts": sampled_drafts}
    return make_config(target, method, head, spec_kw=spec, **kw)


@pytest.fixture(scope="module")
def head_dir(tiny_target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle_tree")
    save_eagle_head(random_eagle_head(load_model(tiny_target), norms=True), directory)
    return directory


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """A target with an 8-token vocabulary and a random head: top-k children cover much of
    it, so trees accept deep paths through nodes other than the first child."""
    root = tmp_path_factory.mktemp("small_vocab")
    target = write_model(root / "t", layers=2, hidden=32, seed=7, scale=1.5, model_vocab=8)
    head = root / "head"
    save_eagle_head(random_eagle_head(load_model(target), norms=True, seed=2, scale=1.0), head)
    return target, head


# ---------------------------------------------------------------- the tree's verify inputs


PARENTS = [-1, -1, 0, 0, 1, 2, 5]  # node depths 1 1 2 2 2 3 4


def path_of(node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(node)
        node = PARENTS[node]
    return path[::-1]


def test_ancestors_and_mask_follow_the_paths():
    parents = torch.tensor([PARENTS])
    depths = torch.tensor([[len(path_of(i)) for i in range(len(PARENTS))]])
    ancestors = tree_ancestors(parents, 4)[0]
    for i in range(len(PARENTS)):
        assert ancestors[i].nonzero().flatten().tolist() == path_of(i)
    base, lmax = 5, 16
    dev = SimpleNamespace(
        base=torch.tensor([base]), target_meta=SimpleNamespace(kv_slots=torch.zeros(1, lmax))
    )
    drafts = tree_drafts(dev, torch.arange(7)[None], parents, depths, 4)
    assert drafts.positions[0].tolist() == [base] + [base + int(d) for d in depths[0]]
    assert drafts.mask[0, 0].nonzero().flatten().tolist() == list(range(base + 1))
    for i in range(len(PARENTS)):
        seen = drafts.mask[0, 1 + i].nonzero().flatten().tolist()
        assert seen == list(range(base + 1)) + [base + 1 + j for j in path_of(i)]


def test_each_rows_scratch_sits_on_pages_of_its_own():
    """A paged kernel (FlashInfer) reads a row's keys page by page: each page's first slot,
    then the slots after it. A tree level's keys (the committed ones over whole pages, then the
    row's scratch) read back as themselves, and no two rows share a scratch page."""
    ps, size, rows = 4, 6, torch.tensor([0, 3, 1])
    committed = torch.randperm(10)[: 2 * len(rows)].view(-1, 2)  # 2 pages a row
    committed = (committed[..., None] * ps + torch.arange(ps)).flatten(1)  # [B, 8]
    scratch = tree_drafter.scratch_slots(10 * ps, rows, size, ps)  # past the 10 pages
    keys = torch.cat([committed, scratch], 1)  # [B, 14]
    pages = torch.div(keys[:, ::ps], ps, rounding_mode="floor")  # [B, 4]
    read = (pages[..., None] * ps + torch.arange(ps)).flatten(1)[:, : keys.shape[1]]
    assert torch.equal(read, keys)
    scratch_pages = [set(torch.div(row, ps, rounding_mode="floor").tolist()) for row in scratch]
    assert all(a.isdisjoint(b) for i, a in enumerate(scratch_pages) for b in scratch_pages[i + 1 :])


def test_refill_runs_up_to_the_longest_accepted_prefix_on_the_cpu():
    accepted = torch.tensor([0, 2, 1])
    assert refill_columns(accepted, width=5) == 3  # accepted drafts and the emitted token
    assert refill_columns(torch.tensor([4]), width=5) == 5
    # elsewhere the accepted counts stay on the device: every column runs, no sync
    assert refill_columns(accepted.to("meta"), width=5) == 5


def test_fixed_tree_ancestors_hold_for_every_prefix():
    # a step drafting fewer nodes than the tree has takes the corner of its ancestors
    tree = tree_drafter.FixedTree(FIXED, torch.device("cpu"))
    for n in range(1, tree.size + 1):
        parents = tree.parents[None, :n]
        assert torch.equal(tree.ancestors[:, :n, :n], tree_ancestors(parents, tree.depth))


def grown(growth, head):
    """Drive a tree shape's growth with `head` (an Expansion -> (logits, features)); returns
    the tree and the expansions asked for."""
    asked = []
    try:
        expansion = next(growth)
        while True:
            asked.append(expansion)
            expansion = growth.send(head(expansion))
    except StopIteration as done:
        return done.value, asked


def ranked_head(vocab: int):
    """A stand-in head: token t's rank-r child is (3 t + 1 + r) % vocab; a node's feature is
    its own token, so that an expansion's features name its nodes' parents."""

    def logits(ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., vocab]
        best = (3 * ids + 1)[..., None]
        return -((torch.arange(vocab) - best) % vocab).float()

    return logits, lambda x: (logits(x.ids), x.ids[..., None].float())


def test_tree_shapes_grow_without_a_head():
    """A shape grows from the root's outputs and what it is sent for each expansion, without a
    head of its own: driven by a stand-in, a fixed tree is its paths' ranked children, each
    expansion carries its nodes' parents' features, and a dynamic tree's nodes are top
    children of their parents, parents first."""
    vocab, base = 16, torch.tensor([7, 9])
    logits, head = ranked_head(vocab)
    roots = logits(torch.zeros(2, dtype=torch.long)), torch.zeros(2, 1)
    fixed = tree_drafter.FixedTree(FIXED, torch.device("cpu"))
    tree, asked = grown(fixed.grow(roots, base, fixed.size), head)
    # the root (token 0) ranks 1, 2, ...; token 1 ranks 4, 5; token 2: 7; 4: 13, 14; 13: 8
    assert tree.tokens.tolist() == [[1, 2, 4, 5, 7, 13, 14, 8]] * 2
    assert [x.level for x in asked] == [1, 2, 3]
    for x in asked:  # each node run was fed its parent's feature (its parent's token)
        parents = x.features[..., 0].long()
        assert ((x.ids - 3 * parents - 1) % vocab < 2).all()  # FIXED's ranks are 0 and 1
    assert asked[0].features.eq(0).all()  # the root's children: the root's feature
    # the nodes with children, each fed its parent's: (0, 0) = 4 under 1, (0, 0, 0) = 13 under 4
    assert [x.ids.tolist() for x in asked[1:]] == [[[4]] * 2, [[13]] * 2]
    assert [x.features[..., 0].tolist() for x in asked[1:]] == [[[1.0]] * 2, [[4.0]] * 2]

    dynamic = tree_drafter.DynamicTree(depth=3, topk=2, device=torch.device("cpu"))
    tree, asked = grown(dynamic.grow(roots, base, 5), head)
    assert [x.level for x in asked] == [1, 2]
    for row in range(2):
        tokens, parents = tree.tokens[row].tolist(), tree.parents[row].tolist()
        for i, (token, parent) in enumerate(zip(tokens, parents, strict=True)):
            assert parent < i  # parents first
            above = 0 if parent < 0 else tokens[parent]
            assert (token - 3 * above - 1) % vocab < 2  # one of its parent's top 2 children


def test_tree_verify_forward_equals_dense_path_forwards(tiny_target):
    """The target over a tree (positions by depth, slots by node index, the tree mask) gives
    each node the hidden state of a dense causal forward over the prompt and its path."""
    torch.set_num_threads(1)  # tiny products of ever new shapes crawl on two busy cores
    model = load_model(tiny_target)
    cfg = model.config
    page_size, prompt = 4, [5, 17, 3, 250, 9, 11, 42]
    table = PageTable(page_size)
    table.grow(shuffled_allocator(32, 1), len(prompt) + len(PARENTS) + 1)
    cache = KVCache(cfg.num_layers, 32, page_size, cfg.num_kv_heads, cfg.head_dim)
    cache.data.normal_()  # a read of a wrong slot shows

    def metadata(q_len: int, kv_len: int, positions: list[int], slots: list[int]):
        pages = -(-kv_len // page_size)
        return paged_metadata(
            torch.tensor([0, q_len]),
            torch.tensor([0, pages]),
            torch.tensor(table.pages[:pages]),
            torch.tensor([kv_len - (pages - 1) * page_size]),
            torch.tensor(positions),
            torch.tensor(slots),
            page_size,
            q_len,
            pages * page_size,
        )

    n = len(prompt) - 1  # the prompt but its last token, which is the tree's root
    meta = metadata(n, n, list(range(n)), table.slots(0, n))
    model(
        torch.tensor(prompt[:n]), torch.arange(n), TorchPagedAttention(meta, cache, cfg.num_heads)
    )
    tokens = torch.tensor([[60, 61, 62, 63, 64, 65, 66]])
    parents = torch.tensor([PARENTS])
    depths = torch.tensor([[len(path_of(i)) for i in range(len(PARENTS))]])
    width, kv_len = len(PARENTS) + 1, n + len(PARENTS) + 1
    meta = metadata(width, kv_len, list(range(n, kv_len)), table.slots(n, kv_len))
    dev = SimpleNamespace(base=torch.tensor([n]), target_meta=meta)
    drafts = tree_drafts(dev, tokens, parents, depths, 4)
    meta = replace(meta, q_positions=drafts.positions, mask=drafts.mask)
    ids = torch.cat([torch.tensor(prompt[n:]), tokens[0]])
    attn = TorchPagedAttention(meta, cache, cfg.num_heads)
    hidden, _ = model(ids, drafts.positions.flatten(), attn)
    for i in range(-1, len(PARENTS)):
        seq = prompt + [int(tokens[0, j]) for j in (path_of(i) if i >= 0 else [])]
        dense, _ = model(torch.tensor(seq), torch.arange(len(seq)), CausalAttention(1, len(seq)))
        torch.testing.assert_close(hidden[1 + i], dense[-1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("page_size", [2, 4])
def test_accepted_path_moves_into_place_across_pages(page_size):
    gen = torch.Generator().manual_seed(page_size)
    cache = KVCache(2, 24, page_size, 2, 3)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    base, nodes = [5, 2], 8
    allocator = shuffled_allocator(24, page_size)
    tables = [PageTable(page_size), PageTable(page_size)]
    for table in tables:
        table.grow(allocator, 16)
    tail = torch.tensor([t.slots(b, b + nodes + 2) for t, b in zip(tables, base, strict=True)])
    # row 0 accepts nodes 1, 4, 6 (sources past the page of their destinations); row 1 none
    path = torch.tensor([[1, 4, 6, -1], [-1, -1, -1, -1]])
    accepted = torch.tensor([3, 0])
    before = cache.data.clone()
    move_tree_path(cache, tail, path, accepted)
    expected = before.clone()
    for j, node in enumerate([1, 4, 6]):
        s, d = int(tail[0, 1 + node]), int(tail[0, 1 + j])
        expected[:, d // page_size, :, d % page_size] = before[:, s // page_size, :, s % page_size]
    pages = {int(tail[0, i]) // page_size for i in (1, 2, 3, 5, 7)}
    assert len(pages) > 1
    assert torch.equal(cache.data, expected)


def test_best_nodes_form_a_tree_with_parents_first():
    # candidates: level 1 = 0, 1; level 2 = 2..5 (children of 0: 2, 3; of 1: 4, 5)
    scores = torch.tensor([[-1.0, -0.5, -1.0, -3.0, -0.5, -0.7]])  # 2 ties its parent
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15]])
    parents = torch.tensor([[-1, -1, 0, 0, 1, 1]])
    depths = torch.tensor([1, 1, 2, 2, 2, 2])
    node_tokens, node_parents, node_depths = _best(scores, tokens, parents, depths, 5)
    assert node_tokens.tolist() == [[10, 11, 12, 14, 15]]
    assert node_parents.tolist() == [[-1, -1, 0, 1, 1]]
    assert node_depths.tolist() == [[1, 1, 2, 2, 2]]


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(tree="wide"), "unknown tree"),
        (dict(method="draft", tree="fixed"), "needs a head"),
        (dict(tree="dynamic", tree_nodes=30, tree_depth=2, tree_topk=3), "12 candidates"),
        (dict(tree="fixed", tree_paths=((0,), (1, 0))), "lacks its parent"),
    ],
)
def test_tree_config_is_validated(kw, message):
    with pytest.raises(ValueError, match=message):
        SpecConfig(**({"method": "eagle"} | kw))


def test_server_flags_make_the_tree_config(capsys):
    argv = ["--speculative", "eagle", "--draft", "head", "--tree", "dynamic"]
    config, _ = config_from_args(argv + ["--tree-nodes", "12", "--tree-depth", "3"])
    spec = config.spec
    assert (spec.tree, spec.tree_nodes, spec.tree_depth) == ("dynamic", 12, 3)
    assert spec.num_draft_tokens == 12  # the engine's k: every node is verified
    with pytest.raises(SystemExit):
        config_from_args(argv + ["--tree-nodes", "99"])
    assert "tree_nodes must be in 1..64" in capsys.readouterr().err


# ---------------------------------------------------------------- drafting


@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
async def test_tree_nodes_are_the_heads_top_children(tiny_target, head_dir, tree):
    """Each drafted node is one of the top-k children of its parent under the head run
    densely over the committed pairs and then its own features along the node's path (for a
    fixed tree: exactly the child of its rank): checks the head's tree pass (scratch KV,
    mask, positions) and the tree bookkeeping."""
    prompts = {"a": ragged_prompts(1, 300, seed=3)[0] * 2, "b": [7, 8, 9], "c": list(range(3, 30))}
    config = tree_config(tiny_target, head_dir, tree, max_batch_tokens=8)
    async with running(config) as engine:
        calls = []
        propose = engine.drafter.propose

        def recording(plan, dev):
            drafts = propose(plan, dev)
            ids = [s.request.request_id for s in plan.seqs]
            calls.append((ids, dev.base.tolist(), drafts.tokens.tolist(), drafts.parents.tolist()))
            return drafts

        engine.drafter.propose = recording
        streams = {name: engine.submit(p, GREEDY, request_id=name) for name, p in prompts.items()}
        outputs = {name: token_ids([d async for d in s]) for name, s in streams.items()}
    assert len(calls) > 5
    head = engine.drafter.head
    torch.set_num_threads(1)
    ranks = {node: path[-1] for node, path in enumerate(sorted(FIXED, key=lambda p: (len(p), p)))}
    for ids, bases, tokens, parents in calls:
        for name, base, nodes, above in zip(ids, bases, tokens, parents, strict=True):
            committed = (prompts[name] + outputs[name])[: base + 1]
            for node, token in enumerate(nodes):
                if token < 0:
                    continue
                path = [node]
                while above[path[-1]] >= 0:
                    path.append(above[path[-1]])
                walk = [nodes[i] for i in path[::-1][:-1]]
                top = dense_top(head, committed, walk, TREES["dynamic"]["tree_topk"] + 1)
                if tree == "fixed":
                    assert token == top[ranks[node]], (name, base, node)
                else:
                    assert token in top[: TREES["dynamic"]["tree_topk"]], (name, base, node)


def test_fixed_tree_children_are_independent_draws_of_q():
    """A sampled node's ranked children: each rank a draw of q, independent of the others."""
    draws = 40_000
    q = torch.tensor([0.1, 0.3, 0.0, 0.4, 0.2, 0.0])
    children = tree_drafter.FixedTree._children(
        q.expand(draws, 1, 6), 2, torch.arange(draws) * 3 + 1, torch.full((draws,), 9)
    )  # [draws, 2]: ranks 0 and 1 of one node
    joint = children[:, 0] * 6 + children[:, 1]
    assert chi_square_pvalue(joint, torch.outer(q, q).flatten()) > 1e-3
    moved = q.clone()
    moved[3], moved[0] = 0.38, 0.12  # 2% of the likeliest token's mass elsewhere
    assert chi_square_pvalue(joint, torch.outer(moved, moved).flatten()) < 1e-3


def dense_top(head, committed: list[int], walk: list[int], k: int) -> list[int]:
    """The head's top-k next tokens after the committed pairs and its own steps along walk."""
    n = len(committed) - 1
    target = head.target
    hidden, _ = target(torch.tensor(committed[:n]), torch.arange(n), CausalAttention(1, n))
    ids, features = committed[1:], hidden
    out = head(torch.tensor(ids), features, torch.arange(n), CausalAttention(1, n))[-1]
    for token in walk:
        ids, features = ids + [token], torch.cat([features, out[None]])
        m = len(ids)
        out = head(torch.tensor(ids), features, torch.arange(m), CausalAttention(1, m))[-1]
    return head.logits(out[None])[0].topk(k).indices.tolist()


# ---------------------------------------------------------------- lossless speculation


@pytest.fixture(scope="module")
def prompts():
    return [[t % 8 for t in p] for p in ragged_prompts(16, 300, seed=21)]


@pytest.fixture(scope="module")
def expected(small, prompts):
    async def plain():
        async with running(make_config(small[0])) as engine:
            return await staggered(engine, prompts, GREEDY)

    return asyncio.run(plain())


@pytest.fixture(scope="module")
def small_eagle3(small, tmp_path_factory):
    """An EAGLE-3 head for `small`'s target over 6 of its 8 tokens."""
    head = tmp_path_factory.mktemp("small_eagle3")
    save_eagle3_head(random_eagle3_head(load_model(small[0]), (1, 2), draft_vocab=6), head)
    return small[0], head


@pytest.fixture(scope="module")
def small_mtp(small, tmp_path_factory):
    """An MTP head for `small`'s target (its pairs sit one position later than EAGLE's)."""
    head = tmp_path_factory.mktemp("small_mtp")
    save_mtp_head(random_mtp_head(load_model(small[0]), seed=4, scale=1.0), head)
    return small[0], head


@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
@pytest.mark.parametrize("heads, method", [("small_eagle3", "eagle"), ("small_mtp", "mtp")])
async def test_greedy_head_trees_equal_plain(request, prompts, expected, tree, heads, method):
    """EAGLE-3's drafts from a reduced vocabulary are accepted (d2t maps them to the right
    ids); MTP's tree nodes sit one position later than EAGLE's."""
    target, head = request.getfixturevalue(heads)
    config = tree_config(target, head, tree, method=method, pages=48, max_batch_tokens=64)
    async with running(config) as engine:
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
        assert [token_ids(out) for out in outs] == expected
        assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert sum(out[-1].usage.accepted_tokens for out in outs) > 0


@pytest.mark.parametrize("tree", sorted(TREES))
@pytest.mark.parametrize("pages", [256, 48])
async def test_greedy_trees_equal_plain(small, prompts, expected, tree, pages, monkeypatch):
    moved = []  # accepted paths that left the first-child chain (a real KV move)

    def recording(cache, tail_slots, path, accepted):
        steps = torch.arange(path.shape[1])
        off_chain = (path != steps) & (steps < accepted[:, None])
        moved.extend(accepted[off_chain.any(1)].tolist())
        move_tree_path(cache, tail_slots, path, accepted)

    monkeypatch.setattr(tree_drafter, "move_tree_path", recording)
    config = tree_config(*small, tree, pages=pages, max_batch_tokens=64)
    async with running(config) as engine:
        assert await staggered(engine, prompts, GREEDY, seed=5) == expected
        if pages < 100:
            assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    if tree != "chain":
        assert max(moved, default=0) >= 2  # some path of two or more nodes moved


async def test_greedy_rows_of_a_sampled_fixed_tree_step_equal_plain(small, prompts, expected):
    """Greedy requests batched with sampled ones: their children are drawn from one-hot q and
    verified by the multi-draft rule, and must still give plain greedy output."""
    sampled = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True, seed=4)
    async with running(tree_config(*small, "fixed", max_batch_tokens=64)) as engine:
        outs = await asyncio.gather(
            *(engine.generate(p, GREEDY if i % 2 else sampled) for i, p in enumerate(prompts))
        )
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    for i, (out, plain) in enumerate(zip(outs, expected, strict=True)):
        if i % 2:
            assert token_ids(out) == plain
    assert sum(out[-1].usage.accepted_tokens for out in outs[::2]) > 0  # sampled rows accept


@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
async def test_seeded_sampling_with_penalties_and_bias_equals_plain(tiny_target, head_dir, tree):
    """Point-mass drafts (ranked children, as a dynamic tree always drafts) emit exactly what
    plain decoding draws with the same seeds, so the outputs must match token for token,
    penalties counted along each node's own path."""
    params = SamplingParams(
        max_tokens=16,
        temperature=0.9,
        top_p=0.95,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias=((5, 2.0), (7, -3.0), (11, 1.5)),
        ignore_eos=True,
        seed=3,
    )
    prompts = ragged_prompts(6, 300, seed=8)
    async with running(make_config(tiny_target, pages=128)) as engine:
        plain = await staggered(engine, prompts, params)
    config = tree_config(tiny_target, head_dir, tree, sampled_drafts=False, pages=128)
    async with running(config) as engine:
        assert await staggered(engine, prompts, params, seed=2) == plain
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
async def test_tree_logprobs_equal_plain(small, tree):
    """Each emitted token's logprobs come from the verify row of its parent on the path."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
    prompt = [1, 5, 2, 7, 3]
    async with running(make_config(small[0])) as engine:
        plain = [lp for d in await engine.generate(prompt, params) for lp in d.logprobs or []]
    async with running(tree_config(*small, tree)) as engine:
        deltas = await engine.generate(prompt, params)
    assert deltas[-1].usage.accepted_tokens > 0
    tree_lps = [lp for d in deltas for lp in d.logprobs or []]
    assert [lp.token_id for lp in tree_lps] == [lp.token_id for lp in plain]
    for got, want in zip(tree_lps, plain, strict=True):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t for t, _ in got.top] == [t for t, _ in want.top]


# ---------------------------------------------------------------- the sampling law


@pytest.fixture(scope="module")
def stats_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree_stats")
    target = write_model(root / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=VOCAB)
    head = root / "head"
    save_eagle_head(random_eagle_head(load_model(target), norms=True, seed=5, scale=1.5), head)
    return target, head


async def tree_joint(target, head, tree: str, draws: int) -> dict[tuple[int, ...], int]:
    trees = {
        "fixed": dict(tree="fixed", tree_paths=((0,), (1,), (0, 0), (1, 0), (0, 0, 0))),
        "dynamic": dict(tree="dynamic", tree_nodes=5, tree_depth=3, tree_topk=2),
    }
    config = make_config(
        target,
        "eagle",
        head,
        pages=4 * draws,
        page_size=4,
        max_running=draws,
        max_waiting=draws,
        max_batch_tokens=len(PROMPT) * draws,
        max_model_len=16,
    )
    config = replace(config, spec=replace(config.spec, adaptive_k=False, **trees[tree]))
    async with running(config) as engine:
        outs = await asyncio.gather(
            # no seeds: the rejection rule (seeded requests take the coupling, tests/test_seeded.py)
            *(engine.generate(PROMPT, SamplingParams(**PARAMS)) for _ in range(draws))
        )
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
    assert all(out[-1].usage.draft_tokens >= 2 for out in outs)  # capped by max_tokens
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(token_ids(out))
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("tree", ["fixed", "dynamic"])
def test_sampled_trees_follow_the_target(stats_models, tree):
    target, head = stats_models
    expected = exact_joint(target)
    draws = DRAWS[tree]
    observed = asyncio.run(tree_joint(target, head, tree, draws))
    assert sum(observed.values()) == draws
    assert all(len(k) == TOKENS for k in observed)
    assert_law(observed, expected, draws)
