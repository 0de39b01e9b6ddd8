"""MTP head: checkpoint layouts, the head's alignment in the engine, and lossless greedy output."""

from __future__ import annotations

import asyncio
import dataclasses
import json

import pytest
import torch
from safetensors.torch import save_file

from core.params import SamplingParams
from models.attention import CausalAttention
from models.checkpoint import CheckpointError, read_safetensors
from models.loader import load_model, save_pretrained
from models.mtp import MTPHead, load_mtp_head, save_mtp_head
from tests import stats
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import random_mtp_head, write_model

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def run_head(head: MTPHead, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Logits [S, V] of the head over one sequence of pairs (ids [S], hidden [S, H])."""
    s = ids.shape[0]
    with torch.no_grad():
        return head.logits(head(ids, hidden, torch.arange(s), CausalAttention(1, s)))


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module")
def head_dir(tiny_target, target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("mtp")
    save_mtp_head(random_mtp_head(target, seed=7), directory)
    return directory


# ---------------------------------------------------------------- checkpoints


def test_standalone_round_trip(target, tmp_path):
    head = random_mtp_head(target, seed=1)
    save_mtp_head(head, tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["TandemMTPHead"]
    loaded = load_mtp_head(tmp_path, target)
    assert loaded.target is target and "embed_tokens.weight" not in loaded.state_dict()
    for name, t in head.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    ids, hidden = torch.tensor([5, 9, 2]), torch.randn(3, target.config.hidden_size)
    assert torch.allclose(run_head(loaded, ids, hidden), run_head(head, ids, hidden))


def test_deepseek_layout_after_the_target_layers(tiny_target, target, tmp_path):
    """A Llama checkpoint with an MTP layer at index num_hidden_layers, DeepSeek's names; the
    layer's own embed_tokens and shared_head.head are ignored (the target's are shared)."""
    save_pretrained(target, tmp_path, dtype=torch.float32)
    head = random_mtp_head(target, seed=2)
    n = target.config.num_layers
    tensors = read_safetensors(tmp_path)
    for name, t in head.state_dict().items():
        tensors[f"model.layers.{n}.{name.removeprefix('block.')}"] = t.contiguous()
    tensors[f"model.layers.{n}.embed_tokens.weight"] = torch.zeros_like(target.embed_tokens.weight)
    tensors[f"model.layers.{n}.shared_head.head.weight"] = torch.zeros_like(target.lm_head.weight)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    assert f"model.layers.{n}.eh_proj.weight" in tensors
    loaded = load_mtp_head(tmp_path, target)
    ids, hidden = torch.tensor([1, 7, 3, 3]), torch.randn(4, target.config.hidden_size)
    assert torch.allclose(run_head(loaded, ids, hidden), run_head(head, ids, hidden))


def test_concat_order_is_embedding_first(target, tmp_path):
    """eh_proj reading only its first half must make the head depend on the token alone."""
    head = random_mtp_head(target, seed=3)
    size = target.config.hidden_size
    with torch.no_grad():
        head.eh_proj.weight[:, size:] = 0  # [H, 2H]: the hidden half reads nothing
    save_mtp_head(head, tmp_path)
    loaded = load_mtp_head(tmp_path, target)
    ids = torch.tensor([4, 11])
    h1, h2 = torch.randn(2, size), torch.randn(2, size)
    assert torch.allclose(run_head(loaded, ids, h1), run_head(loaded, ids, h2))
    assert not torch.allclose(
        run_head(loaded, ids, h1), run_head(loaded, torch.tensor([4, 12]), h1)
    )


def _rewrite(directory, edit) -> None:
    tensors = read_safetensors(directory)
    edit(tensors)
    save_file(tensors, str(directory / "model.safetensors"))


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop("model.layers.0.hnorm.weight"), "missing"),
        (lambda t: t.update({"model.layers.0.extra.weight": torch.zeros(2)}), "unexpected"),
        (lambda t: t.update({"model.layers.0.eh_proj.weight": torch.zeros(64, 64)}), "shape"),
    ],
)
def test_bad_checkpoints_are_named(target, tmp_path, edit, message):
    save_mtp_head(random_mtp_head(target), tmp_path)
    _rewrite(tmp_path, edit)
    with pytest.raises(CheckpointError, match=message):
        load_mtp_head(tmp_path, target)


def test_a_plain_model_is_not_an_mtp_head(tiny_target, target):
    with pytest.raises(CheckpointError, match="no MTP head"):
        load_mtp_head(tiny_target, target)


async def test_mtp_needs_a_head_directory(tiny_target):
    with pytest.raises(ValueError, match="no shipped MTP head"):
        async with running(make_config(tiny_target, "mtp", None)):
            pass


# ---------------------------------------------------------------- in the engine


def copy_head(target_dir, directory):
    """A one-layer target whose embeddings have unit RMS, and a head that is that target: its
    eh_proj passes the (unit-normed) embedding through, its block is the target's layer and its
    norm the target's final norm. Every draft token it proposes is the target's own choice."""
    write_model(target_dir, layers=1, seed=5)
    target = load_model(target_dir)
    with torch.no_grad():
        weight = target.embed_tokens.weight
        weight /= weight.pow(2).mean(-1, keepdim=True).sqrt()
    save_pretrained(target, target_dir, dtype=torch.float32)
    head = random_mtp_head(target)
    size = target.config.hidden_size
    with torch.no_grad():
        head.eh_proj.weight.zero_()
        head.eh_proj.weight[:, :size] = torch.eye(size)
        head.block.load_state_dict(target.layers[0].state_dict())
        head.shared_head.norm.load_state_dict(target.norm.state_dict())
    save_mtp_head(head, directory)


@pytest.mark.parametrize("k", [1, 3])
async def test_a_head_equal_to_the_target_is_always_accepted(tmp_path, k):
    """Pins positions, slots and the refill span (k = 1: as the insert kernel moves them on
    the device): any misalignment costs acceptance."""
    copy_head(tmp_path / "t", tmp_path / "h")
    config = make_config(tmp_path / "t", "mtp", tmp_path / "h", k=k, max_batch_tokens=16)
    async with running(config) as engine:
        prompts = ragged_prompts(4, 300, seed=2)
        outs = await asyncio.gather(*(engine.generate(p, GREEDY) for p in prompts))
    for out in outs:
        usage = out[-1].usage
        assert usage.draft_tokens > 0 and usage.accepted_tokens == usage.draft_tokens


async def test_deferred_logits_match_the_head_over_the_whole_sequence(tiny_target, head_dir):
    """After the last step, the head's deferred logits are those of the head run from scratch
    over every pair (t_p, H_{p-1}) with the target's hidden states (zero at position 0); a
    prompt longer than the token budget checks the pairs across prefill chunks (a float32
    cache: the reference attends in float32)."""
    config = make_config(tiny_target, "mtp", head_dir, k=3, max_batch_tokens=16, kv_dtype="float32")
    prompt = ragged_prompts(1, 300, seed=4)[0] * 2
    async with running(config) as engine:
        ids = prompt + token_ids(await engine.generate(prompt, GREEDY))
        await engine.wait_idle()
        deferred = engine.drafter.deferred_logits[0].clone()  # the only request had row 0
        head = engine.drafter.head
    target = head.target
    s = len(ids)
    with torch.no_grad():
        hidden, _ = target(torch.tensor(ids), torch.arange(s), CausalAttention(1, s))
    shifted = torch.cat((torch.zeros_like(hidden[:1]), hidden[:-1]))  # [S, H] H_{p-1}
    expected = run_head(head, torch.tensor(ids), shifted)[-1]
    assert torch.allclose(deferred, expected, atol=1e-4)


@pytest.mark.parametrize("k, pages", [(3, 256), (3, 40), (1, 256), (1, 40)])
async def test_greedy_mtp_equals_plain(tiny_target, head_dir, ragged16, plain16, k, pages):
    config = make_config(tiny_target, "mtp", head_dir, k=k, pages=pages, max_batch_tokens=64)
    async with running(config) as engine:
        assert await staggered(engine, ragged16, GREEDY, seed=5) == plain16
        if pages < 100:
            assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


# ---------------------------------------------------------------- sampled drafts


async def mtp_joint(target_dir, head_dir, k: int) -> dict[tuple[int, ...], int]:
    """Counts of the first TOKENS tokens of N requests without seeds, MTP with sampled drafts."""
    config = make_config(
        target_dir,
        "mtp",
        head_dir,
        k=k,
        pages=3 * stats.N,
        max_running=stats.N,
        max_waiting=stats.N,
        max_batch_tokens=len(stats.PROMPT) * stats.N,
        max_model_len=16,
    )
    config = dataclasses.replace(config, spec=dataclasses.replace(config.spec, sampled_drafts=True))
    params = [SamplingParams(**stats.PARAMS) for _ in range(stats.N)]  # the rejection rule
    async with running(config) as engine:
        outs = await asyncio.gather(*(engine.generate(stats.PROMPT, p) for p in params))
    assert all(out[-1].usage.draft_tokens >= 1 for out in outs)
    counts: dict[tuple[int, ...], int] = {}
    for out in outs:
        key = tuple(token_ids(out))
        counts[key] = counts.get(key, 0) + 1
    return counts


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("k", [1, 2])
def test_sampled_mtp_follows_target(tmp_path, k):
    """The chi-square of tests/test_speculative_stats.py, with a random MTP head drafting
    (k = 1: the one-token mode)."""
    target_dir = write_model(
        tmp_path / "t", layers=1, hidden=16, seed=3, scale=1.5, model_vocab=stats.VOCAB
    )
    save_mtp_head(random_mtp_head(load_model(target_dir), seed=4, scale=1.5), tmp_path / "h")
    expected = stats.exact_joint(target_dir)
    observed = asyncio.run(mtp_joint(target_dir, tmp_path / "h", k))
    assert sum(observed.values()) == stats.N
    stats.assert_law(observed, expected, stats.N)


# ---------------------------------------------------------------- one-token mode: no host sync


async def test_one_token_mode_never_syncs_the_host(
    tiny_target, head_dir, ragged16, plain16, forbid_host_sync
):
    unknown: list[int] = []

    def probe(name, plan, dev):
        unknown.extend(plan.unknown if name == "draft" else [])

    config = make_config(tiny_target, "mtp", head_dir, k=1, max_batch_tokens=64, fault=probe)
    async with running(config) as engine:
        outs = await staggered(engine, ragged16, GREEDY, seed=5)
    assert outs == plain16  # no step failed on a conversion, and the output is lossless
    assert sum(unknown) > len(ragged16)  # steps were planned before the last one was sampled


async def test_the_host_sync_guard_catches_a_conversion(tiny_target, head_dir, forbid_host_sync):
    def sync(name, plan, dev):
        if name == "verify" and plan.kind == "decode":
            dev.base.tolist()

    async with running(make_config(tiny_target, "mtp", head_dir, k=1, fault=sync)) as engine:
        out = await engine.generate([1, 2, 3], GREEDY)
    assert out[-1].finish_reason == "error" and "host sync" in out[-1].error
