"""The Qwen2.5-Coder pair's files, small: a random qwen2 target and draft written as GGUF files
of every tensor type the two real files hold (Q4_K, Q6_K, Q5_0, Q8_0), served at those types,
lossless under every drafter; and the real pair where it can be fetched (slow tier)."""

from __future__ import annotations

import asyncio

import pytest

from core.params import SamplingParams
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids
from tests.tiny import write_qwen2_pair

GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(target, draft, heads): GGUF files of a 256-wide qwen2 (K types need 256 inputs)."""
    files = write_qwen2_pair(tmp_path_factory.mktemp("pair"))
    return files["target"], files["draft"], {"eagle": files["eagle"]}


@pytest.fixture(scope="module")
def plain(pair):
    async def run():
        async with running(make_config(pair[0])) as engine:
            return await staggered(engine, ragged_prompts(6, 300, seed=3), GREEDY)

    return asyncio.run(run())


@pytest.mark.parametrize(
    "method, spec_kw",
    [
        ("draft", {}),
        ("draft", {"draft_vocab": 160}),
        ("ngram", {}),
        ("suffix", {}),
        ("hybrid", {"hybrid_head": "draft"}),
        ("eagle", {}),
    ],
)
async def test_every_drafter_is_lossless_on_the_pairs_types(pair, plain, method, spec_kw):
    target, draft, heads = pair
    drafter = heads.get(method, draft)
    config = make_config(target, method, drafter, k=3, spec_kw=spec_kw)
    async with running(config) as engine:
        assert engine.model.layers[0].self_attn.qkv.parts  # Q4_K q|k beside a Q6_K v: parts
        assert await staggered(engine, ragged_prompts(6, 300, seed=3), GREEDY) == plain


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_the_real_pair_is_lossless_under_every_drafter():
    """Qwen2.5-Coder-1.5B-Instruct served by name (the default policy over its 0.5B draft
    model, n-gram and suffix decoding), each request naming its drafter: the same greedy
    answer, token for token. (The draft model over the whole vocabulary, on these types:
    test_every_drafter_is_lossless_on_the_pairs_types.)"""
    chat = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    outputs = {}

    async def answer(engine, method: str) -> list[int]:
        params = SamplingParams(max_tokens=32, temperature=0, speculative_method=method)
        deltas = await engine.generate(engine.tokenizer.encode_chat(chat), params)
        if method == "draft":
            assert deltas[-1].usage.accepted_tokens > 0
        return token_ids(deltas)

    config = make_config("qwen2.5-coder", "auto", k=4, max_model_len=1024)
    async with running(config) as engine:
        assert set(engine.config.spec.drafters) == {"none", "auto", "draft", "ngram", "suffix"}
        for method in engine.config.spec.drafters:
            outputs[method] = await answer(engine, method)
    assert "def " in engine.tokenizer.decode(outputs["none"])
    for name, output in outputs.items():
        assert output == outputs["none"], name
