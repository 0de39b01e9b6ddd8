"""Decode forwards over static buffers (`--cuda-graphs`): the path CUDA graphs capture, run
eagerly on the CPU, against the engine's own forwards and against plain decoding."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from core.params import SamplingParams
from engine.config import EngineConfig
from kv.cache import KVCache
from models.attention import TorchPagedAttention, paged_metadata
from models.graphs import MIN_KEYS, Bucket, GraphedForward, StaticInputs, bucket_of
from models.llama import prepare_for_inference
from models.loader import load_model
from models.mtp import save_mtp_head
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import random_eagle_head, random_mtp_head

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
PAGE = 4


def _meta(lens: list[int], rows: int, tree: bool = False):
    """Metadata of a decode forward of `rows` tokens for sequences with `lens` keys after it,
    each on pages of its own (sequence i from page 10 * i)."""
    b = len(lens)
    pages = [list(range(10 * i, 10 * i + -(-n // PAGE))) for i, n in enumerate(lens)]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + len(p))
    positions = torch.tensor([n - rows + j for n in lens for j in range(rows)])
    written = [(i, p) for i, n in enumerate(lens) for p in range(n - rows, n)]
    slots = torch.tensor([pages[i][p // PAGE] * PAGE + p % PAGE for i, p in written])
    ints = lambda x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    mask = None
    if tree:  # each node sees the prefix, itself and node 0
        mask = torch.zeros(b, rows, max(lens), dtype=torch.bool)
        for i, n in enumerate(lens):
            mask[i, :, : n - rows + 1] = True
            mask[i, torch.arange(rows), n - rows + torch.arange(rows)] = True
    return paged_metadata(
        ints([rows * i for i in range(b + 1)]),
        ints(indptr),
        ints([x for p in pages for x in p]),
        ints([(n - 1) % PAGE + 1 for n in lens]),
        positions,
        slots,
        PAGE,
        rows,
        max(lens),
        mask,
    )


def test_buckets_round_the_batch_and_the_keys_up():
    assert bucket_of(_meta([5, 9, 3], rows=2)) == Bucket(4, 2, MIN_KEYS, False)
    assert bucket_of(_meta([MIN_KEYS + 1], rows=1)) == Bucket(1, 1, 2 * MIN_KEYS, False)
    assert bucket_of(_meta([7] * 3, rows=3, tree=True)).tree
    assert bucket_of(_meta([7] * 65, rows=1)) is None  # past the largest batch: eager


def test_padding_rows_forget_an_earlier_steps_sequences():
    """A bucket filled by four sequences, then by one: the three rows past it write to the
    scratch slot and see one key, not the slots the departed sequences had."""
    inputs = StaticInputs(Bucket(4, 2, MIN_KEYS, True), torch.device("cpu"), scratch_slot=999)
    four = _meta([6, 7, 8, 9], rows=2, tree=True)
    inputs.fill(torch.arange(8), four.q_positions.flatten(), four)
    one = _meta([5], rows=2, tree=True)
    assert inputs.fill(torch.tensor([3, 4]), one.q_positions.flatten(), one) == 2
    assert inputs.slot_mapping[2:].eq(999).all() and inputs.kv_slots[1:].eq(999).all()
    assert inputs.kv_lens.tolist() == [5, 1, 1, 1] and inputs.ids[2:].eq(0).all()
    assert inputs.mask[1:].sum().item() == 3 * 2  # each padding row: its one key
    assert torch.equal(inputs.mask[0, :, :5], one.mask[0]) and not inputs.mask[0, :, 5:].any()


@pytest.mark.parametrize("tree", [False, True])
def test_a_static_forward_equals_the_eager_one(tiny_target, tree):
    """The tiny target's logits for three sequences (a bucket of four) through the static
    buffers equal its forward over the step's own metadata, the cache written alike."""
    model = load_model(tiny_target)
    prepare_for_inference(model)
    cfg = model.config
    meta = _meta([6, 11, 9], rows=3, tree=tree)

    def cache():
        gen = torch.Generator().manual_seed(0)
        kv = KVCache(cfg.num_layers, 41, PAGE, cfg.num_kv_heads, cfg.head_dim, torch.float32)
        kv.data.copy_(torch.randn(kv.data.shape, generator=gen))
        return kv

    def forward(kv):
        def run(ids, positions, m):
            hidden, _ = model(ids, positions, TorchPagedAttention(m, kv, cfg.num_heads))
            return hidden, model.logits(hidden)

        return run

    ids = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(1))
    positions = meta.q_positions.flatten()
    with torch.inference_mode():
        eager_cache, static_cache = cache(), cache()
        want = forward(eager_cache)(ids, positions, meta)
        static = GraphedForward(forward(static_cache), torch.device("cpu"), 40 * PAGE, False)
        got = static(ids, positions, meta)
    assert got[0].shape == want[0].shape and got[1].shape == want[1].shape
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
    # the sequences' pages written alike; page 40 holds the padding row's scratch slot
    torch.testing.assert_close(static_cache.data[:, :40], eager_cache.data[:, :40])


def test_graphs_resolve_by_device_and_refuse_what_they_cannot_capture():
    assert not EngineConfig("demo").graphs  # the CPU: eager forwards
    assert EngineConfig("demo", cuda_graphs="on").graphs
    with pytest.raises(ValueError, match="--cuda-graphs"):
        EngineConfig("demo", cuda_graphs="on", batch_invariant=True)
    with pytest.raises(ValueError, match="auto, on or off"):
        EngineConfig("demo", cuda_graphs="yes")


@pytest.fixture(scope="module")
def mtp_head(tiny_target, tmp_path_factory):
    head = tmp_path_factory.mktemp("mtp_graphs")
    save_mtp_head(random_mtp_head(load_model(tiny_target), seed=7), head)
    return head


@pytest.fixture(scope="module")
def eagle_head(tiny_target, tmp_path_factory):
    from models.eagle import save_eagle_head

    head = tmp_path_factory.mktemp("eagle_graphs")
    save_eagle_head(random_eagle_head(load_model(tiny_target), norms=True), head)
    return head


CASES = {  # name: (method, k, spec fields, pages)
    "none": ("none", 3, {}, 256),
    "draft": ("draft", 3, {}, 256),
    "draft-preempted": ("draft", 3, {}, 40),
    "ngram": ("ngram", 3, {}, 256),
    "suffix": ("suffix", 3, {}, 256),
    "hybrid": ("hybrid", 3, {"hybrid_head": "draft"}, 256),
    "eagle": ("eagle", 3, {}, 256),
    "eagle-fixed-tree": ("eagle", 3, {"tree": "fixed"}, 256),
    "eagle-dynamic-tree": ("eagle", 3, {"tree": "dynamic"}, 256),
    "mtp": ("mtp", 3, {}, 256),
    "mtp-one-token": ("mtp", 1, {}, 256),
}


@pytest.mark.parametrize("case", sorted(CASES))
async def test_greedy_output_through_static_buffers_equals_plain(
    case, tiny_target, tiny_draft, eagle_head, mtp_head, ragged16, plain16
):
    """Every drafter, its decode steps' target forwards over the static buffers (padded
    batches as requests come and go), emits plain decoding's tokens."""
    method, k, spec_kw, pages = CASES[case]
    draft = {"draft": tiny_draft, "hybrid": tiny_draft, "eagle": eagle_head, "mtp": mtp_head}
    config = make_config(
        tiny_target,
        method,
        draft.get(method),
        k=k,
        pages=pages,
        max_batch_tokens=64,
        spec_kw=spec_kw,
        cuda_graphs="on",
    )
    async with running(config) as engine:
        assert await staggered(engine, ragged16, GREEDY, seed=5) == plain16
        verifier, drafter = engine.stages.verifier.run, engine.stages.drafter
        assert isinstance(verifier, GraphedForward)
        if case == "mtp-one-token":  # the whole step as one graph (tests/test_step_graph.py)
            assert engine.stages.graph is not None and len(engine.stages.graph.steps) > 1
        else:
            assert len(verifier.inputs) > 1  # buckets ran
        if method in ("draft", "mtp", "eagle"):  # the drafters' forwards too, trees' levels
            assert isinstance(drafter.run, GraphedForward) and drafter.run.inputs
            trees = [b for b in drafter.run.inputs if b.tree]
            assert bool(trees) == ("tree" in case), trees
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_moe_forwards_stay_eager():
    """A MoE layer's routing reads the device from the host (no capture): the DeepSeek-style
    demo's target and MTP layer run their own forwards under --cuda-graphs, losslessly."""
    demo = Path(__file__).resolve().parent.parent / "models" / "demo" / "deepseek"
    prompts = ragged_prompts(3, 4096, seed=9)
    async with running(make_config(demo, pages=512)) as engine:
        plain = [token_ids(await engine.generate(p, GREEDY)) for p in prompts]
    config = make_config(demo, "mtp", None, k=2, pages=512, cuda_graphs="on")
    async with running(config) as engine:
        assert not isinstance(engine.stages.verifier.run, GraphedForward)
        assert not isinstance(engine.stages.drafter.run, GraphedForward)
        assert [token_ids(await engine.generate(p, GREEDY)) for p in prompts] == plain
