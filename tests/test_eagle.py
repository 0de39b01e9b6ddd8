"""EAGLE: the head's checkpoint layouts, its drafts against a dense recompute, and lossless
greedy speculation with a random head (EAGLE-1, our normed variant and EAGLE-3)."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import pytest
import torch
from safetensors.torch import save_file

from core.params import SamplingParams
from models.attention import CausalAttention
from models.checkpoint import CheckpointError, read_safetensors
from models.eagle import EagleHead, load_eagle_head, save_eagle3_head, save_eagle_head
from models.llama import LlamaConfig, LlamaModel
from models.loader import config_to_hf, load_model
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import random_eagle3_head, random_eagle_head

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def safeailab_dir(directory, head: EagleHead, binary: bool):
    """Write `head` (no norms) as SafeAILab does: a Llama config.json with one layer, weights
    in pytorch_model.bin or model.safetensors, with the embedding they carry along."""
    directory.mkdir(parents=True, exist_ok=True)
    config = config_to_hf(head.config, torch.float32) | {"num_hidden_layers": 1}
    (directory / "config.json").write_text(json.dumps(config))
    state = {name: t.clone() for name, t in head.state_dict().items()}
    state["embed_tokens.weight"] = head.target.embed_tokens.weight.clone()
    if binary:
        torch.save(state, directory / "pytorch_model.bin")
    else:
        save_file(state, str(directory / "model.safetensors"))
    return directory


def pairs_output(head: EagleHead, ids: list[int], features: torch.Tensor) -> torch.Tensor:
    """Dense reference: the head over pairs (ids[i], features[i]) at positions 0.. [n, H]."""
    n = len(ids)
    return head(torch.tensor(ids), features, torch.arange(n), CausalAttention(1, n))


@pytest.fixture(scope="module")
def target(tiny_target):
    return load_model(tiny_target)


@pytest.fixture(scope="module", params=["eagle1", "normed", "eagle3"])
def head_dir(request, target, tmp_path_factory):
    directory = tmp_path_factory.mktemp("eagle")
    if request.param == "eagle3":  # the residual entering layer 1, the last layer's output
        save_eagle3_head(random_eagle3_head(target, (1, 2), draft_vocab=200), directory)
    else:
        save_eagle_head(random_eagle_head(target, norms=request.param == "normed"), directory)
    return directory


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("binary", [True, False], ids=["bin", "safetensors"])
def test_loads_the_safeailab_layout(target, tmp_path, binary):
    head = random_eagle_head(target, norms=False)
    loaded = load_eagle_head(safeailab_dir(tmp_path, head, binary), target)
    assert not loaded.norms and loaded.fc.bias is not None
    assert isinstance(loaded.layers[0].input_layernorm, torch.nn.Identity)
    ids, features = [5, 9, 2, 7], torch.randn(4, target.config.hidden_size)
    torch.testing.assert_close(
        pairs_output(loaded, ids, features), pairs_output(head, ids, features)
    )
    assert not any("embed" in name for name in loaded.state_dict())


@pytest.mark.parametrize("norms", [False, True])
def test_save_load_round_trip(target, tmp_path, norms):
    head = random_eagle_head(target, norms=norms)
    save_eagle_head(head, tmp_path)
    loaded = load_eagle_head(tmp_path, target)
    assert loaded.norms == norms
    ids, features = [1, 2, 3], torch.randn(3, target.config.hidden_size)
    torch.testing.assert_close(
        pairs_output(loaded, ids, features), pairs_output(head, ids, features)
    )


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda s: s.pop("layers.0.mlp.up_proj.weight"), "missing ['layers.0.mlp.up_proj.weight']"),
        (lambda s: s.update(extra=torch.zeros(2)), "unexpected ['extra']"),
        (lambda s: s.update({"fc.weight": torch.zeros(3, 3)}), "mis-shaped ['fc.weight (3, 3)"),
    ],
)
def test_bad_checkpoints_name_the_tensor(target, tmp_path, edit, message):
    head = random_eagle_head(target, norms=False)
    safeailab_dir(tmp_path, head, binary=False)
    state = read_safetensors(tmp_path)
    edit(state)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError) as error:
        load_eagle_head(tmp_path, target)
    assert message in str(error.value)


def test_normed_flag_without_norms_is_reported(target, tmp_path):
    safeailab_dir(tmp_path, random_eagle_head(target, norms=False), binary=False)
    config = json.loads((tmp_path / "config.json").read_text()) | {"eagle_norms": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="layers.0.input_layernorm.weight"):
        load_eagle_head(tmp_path, target)


def test_hidden_size_must_match_the_target(target, tmp_path):
    cfg = target.config
    other = LlamaModel(LlamaConfig(cfg.vocab_size, 32, 64, 1, 2, 1))
    save_eagle_head(random_eagle_head(other, norms=True), tmp_path)
    with pytest.raises(CheckpointError, match="hidden size"):
        load_eagle_head(tmp_path, target)


def test_eagle_without_a_head_directory_is_refused(tiny_target):
    with pytest.raises(ValueError, match="no shipped EAGLE head"):
        asyncio.run(running(make_config(tiny_target, "eagle")).__aenter__())


# ---------------------------------------------------------------- drafting


async def test_drafts_equal_a_dense_recompute(tiny_target, head_dir):
    """Every proposed chain equals the head run densely over the committed pairs (token i+1,
    target feature i), then fed its own features: checks pairing, chunked prefill and refill."""
    prompts = {"a": ragged_prompts(1, 300, seed=1)[0] * 2, "b": [7, 8, 9], "c": list(range(3, 30))}
    config = make_config(tiny_target, "eagle", head_dir, k=3, max_batch_tokens=8)
    async with running(config) as engine:
        calls = []
        propose = engine.drafter.propose

        def recording(plan, dev):
            drafts = propose(plan, dev)
            ids = [s.request.request_id for s in plan.seqs]
            calls.append((ids, dev.base.tolist(), drafts.tokens.tolist()))
            return drafts

        engine.drafter.propose = recording
        streams = {name: engine.submit(p, GREEDY, request_id=name) for name, p in prompts.items()}
        outputs = {name: token_ids([d async for d in s]) for name, s in streams.items()}
    assert len(calls) > 10
    head = load_eagle_head(head_dir, load_model(tiny_target))
    # one thread: tiny matmuls of ever new shapes crawl when two threads share two busy cores
    torch.set_num_threads(1)
    for ids, bases, drafts in calls:
        for name, base, chain in zip(ids, bases, drafts, strict=True):
            tokens = prompts[name] + outputs[name]
            assert chain == reference_chain(head, tokens[: base + 1], len(chain)), (name, base)


def reference_chain(head, committed: list[int], k: int) -> list[int]:
    n = len(committed) - 1  # the target has run over committed[:n]
    attn = CausalAttention(1, n)
    hidden, aux = head.target(
        torch.tensor(committed[:n]), torch.arange(n), attn, head.target_layers
    )
    ids, features, chain = committed[1:], head.fuse(torch.cat(aux, -1)) if aux else hidden, []
    for _ in range(k):
        out = pairs_output(head, ids, features)[-1]
        token = int(head.logits(out[None]).argmax())
        chain.append(token)
        ids, features = ids + [token], torch.cat([features, out[None]])
    return chain


@pytest.mark.parametrize("pages", [256, 40])
async def test_greedy_eagle_equals_plain(tiny_target, head_dir, ragged16, plain16, pages):
    config = make_config(tiny_target, "eagle", head_dir, k=3, pages=pages, max_batch_tokens=64)
    async with running(config) as engine:
        assert await staggered(engine, ragged16, GREEDY, seed=5) == plain16
        if pages < 100:
            assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_sampled_drafts_run_and_free_every_page(tiny_target, head_dir):
    config = make_config(tiny_target, "eagle", head_dir, k=3, pages=64)
    config = replace(config, spec=replace(config.spec, sampled_drafts=True))
    params = SamplingParams(max_tokens=16, temperature=0.8, ignore_eos=True)
    async with running(config) as engine:
        outputs = await staggered(engine, ragged_prompts(6, 300, seed=4), params)
        assert [len(o) for o in outputs] == [16] * 6
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
