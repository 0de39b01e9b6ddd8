"""The whole engine in bfloat16 and float16 (what a GPU runs), on the CPU: for every drafter,
speculation equals no speculation in that dtype, and against float32 the output differs only
where float32's top two logits are within that dtype's rounding."""

from __future__ import annotations

import logging

import pytest
import torch

from core.params import SamplingParams
from engine.config import EngineConfig, KVConfig
from tests.engine_util import (
    DRAFTERS,
    ROUNDING,
    assert_departs_only_at_near_ties,
    make_config,
    ragged_prompts,
    running,
    staggered,
    write_drafters,
)

GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def drafters(tiny_target, tmp_path_factory):
    return write_drafters(tiny_target, tmp_path_factory.mktemp("heads"))


@pytest.fixture(scope="module")
def prompts():
    return [p + p[:6] for p in ragged_prompts(4, 300, seed=5)]  # repeats: suffix matches


async def generate(target, prompts, dtype, method="none", draft=None, k=3, **spec):
    """Greedy token ids of each prompt, staggered into one batch."""
    config = make_config(target, method, draft, k=k, dtype=dtype, spec_kw=spec or None)
    async with running(config) as engine:
        return await staggered(engine, prompts, GREEDY)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_speculation_equals_plain_decoding_in_the_dtype(
    tiny_target, drafters, prompts, dtype
):
    plain = await generate(tiny_target, prompts, dtype)
    assert all(len(out) == GREEDY.max_tokens for out in plain)
    for name, (method, draft, k, spec) in DRAFTERS.items():
        draft_dir = drafters[draft] if draft else None
        out = await generate(tiny_target, prompts, dtype, method, draft_dir, k, **spec)
        assert out == plain, name


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
async def test_the_dtype_departs_from_float32_only_at_near_ties(tiny_target, prompts, dtype):
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)
    async with running(make_config(tiny_target)) as engine:
        exact = [await engine.generate(p, params) for p in prompts]
    rounded = await generate(tiny_target, prompts, dtype)
    assert_departs_only_at_near_ties(exact, rounded, ROUNDING[dtype])


@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
async def test_speculation_equals_plain_decoding_at_each_kv_dtype(
    tiny_target, drafters, prompts, kv_dtype
):
    """A float32 model with its KV cache in float32 (its default), or in float16 (a GGUF
    file's default at its quantized types)."""

    async def run(method="none", draft=None, k=3, **spec):
        config = make_config(tiny_target, method, draft, k=k, kv_dtype=kv_dtype, spec_kw=spec)
        async with running(config) as engine:
            assert engine.stages.verifier.cache.data.dtype == getattr(torch, kv_dtype)
            return await staggered(engine, prompts, GREEDY)

    plain = await run()
    for name, (method, draft, k, spec) in DRAFTERS.items():
        assert await run(method, drafters[draft] if draft else None, k, **spec) == plain, name


@pytest.mark.parametrize(
    "model, flags, want",
    [
        ("hf", {}, ("float32", "the dtype the model computes in")),
        ("hf", {"dtype": "bfloat16"}, ("bfloat16", "the dtype the model computes in")),
        ("gguf", {}, ("float16", "a GGUF file served at its quantized types")),
        ("gguf", {"weights": "float32"}, ("float32", "the dtype the model computes in")),
        ("hf", {"kv": KVConfig(dtype="float16")}, ("float16", "--kv-dtype")),
        ("smollm2", {}, ("float16", "a GGUF file served at its quantized types")),
    ],
)
def test_the_kv_caches_default_dtype_follows_what_was_loaded(model, flags, want):
    path = {"hf": "some/directory", "gguf": "model.gguf"}.get(model, model)
    assert EngineConfig(path, **flags).kv_dtype_choice == want


async def test_the_start_log_names_the_kv_dtype_and_why(tiny_quant_target, caplog):
    caplog.set_level(logging.INFO, "tandem.engine")
    async with running(make_config(tiny_quant_target)) as engine:
        assert engine.stages.verifier.cache.data.dtype == torch.float16
    assert "the KV cache in float16: a GGUF file served at its quantized types" in caplog.text
