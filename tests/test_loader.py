"""Checkpoint directories: config parsing, clear errors, sharding, and the save round trip."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file

from models.attention import CausalAttention
from models.checkpoint import CheckpointError, read_config, read_safetensors
from models.llama import LlamaConfig, LlamaModel
from models.loader import (
    checkpoint_dtype,
    config_from_hf,
    config_to_hf,
    eos_token_ids,
    load_model,
    save_pretrained,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def tiny_config(arch: str = "LlamaForCausalLM") -> LlamaConfig:
    return LlamaConfig(
        vocab_size=80,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        rope_theta=20000.0,
        rope_scaling=LLAMA3_ROPE if arch == "LlamaForCausalLM" else {},
        max_position_embeddings=256,
        tie_word_embeddings=arch == "Qwen2ForCausalLM",
        attention_bias=arch == "Qwen2ForCausalLM",
        architecture=arch,
        bos_token_id=1,
        eos_token_id=2,
    )


def tiny_model(arch: str = "LlamaForCausalLM") -> LlamaModel:
    model = LlamaModel(tiny_config(arch))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    return model.eval()


def logits(model: LlamaModel, tokens: torch.Tensor) -> torch.Tensor:
    """[T, vocab] for one sequence tokens [T]."""
    n = tokens.shape[0]
    with torch.no_grad():
        hidden, _ = model(tokens, torch.arange(n), CausalAttention(1, n))
        return model.logits(hidden)


def rewrite_config(directory: Path, **changes: object) -> None:
    config = read_config(directory)
    config.update(changes)
    (directory / "config.json").write_text(json.dumps(config))


def rewrite_weights(directory: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    save_pretrained(tiny_model(), tmp_path, dtype=torch.float32)
    return tmp_path


TOKENS = torch.tensor([3, 17, 42, 5, 79, 0, 11, 64, 23, 8])


# ---------------------------------------------------------------- errors


def test_missing_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_model(tmp_path)


def test_missing_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors"):
        load_model(checkpoint)


def test_unsupported_architecture(checkpoint):
    rewrite_config(checkpoint, architectures=["GPT2LMHeadModel"])
    with pytest.raises(CheckpointError, match="GPT2LMHeadModel"):
        load_model(checkpoint)


def test_unsupported_rope_type(checkpoint):
    rewrite_config(checkpoint, rope_scaling={"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(CheckpointError, match="rope type 'yarn'"):
        load_model(checkpoint)


def test_missing_tensor_is_named(checkpoint):
    tensors = read_safetensors(checkpoint)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    rewrite_weights(checkpoint, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        load_model(checkpoint)


def test_missing_lm_head_when_untied(checkpoint):
    tensors = read_safetensors(checkpoint)
    del tensors["lm_head.weight"]
    rewrite_weights(checkpoint, tensors)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        load_model(checkpoint)


def test_unexpected_tensor_is_named(checkpoint):
    tensors = read_safetensors(checkpoint) | {"model.layers.0.extra.weight": torch.zeros(2)}
    rewrite_weights(checkpoint, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.0\.extra\.weight"):
        load_model(checkpoint)


def test_misshaped_tensor_names_both_shapes(checkpoint):
    tensors = read_safetensors(checkpoint)
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(8, 32)  # should be [16, 32]
    rewrite_weights(checkpoint, tensors)
    pattern = r"k_proj\.weight.*\(8, 32\).*\(16, 32\)"
    with pytest.raises(CheckpointError, match=pattern):
        load_model(checkpoint)


def test_missing_shard(checkpoint):
    tensors = read_safetensors(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    index = {"weight_map": {name: "model-00001-of-00001.safetensors" for name in tensors}}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00001-of-00001.safetensors"):
        load_model(checkpoint)


def test_sliding_window():
    hf = config_to_hf(tiny_config("MistralForCausalLM"))
    assert config_from_hf(hf | {"sliding_window": None}).architecture == "MistralForCausalLM"
    assert config_from_hf(hf | {"sliding_window": 256}).max_position_embeddings == 256
    with pytest.raises(CheckpointError, match="sliding_window=128"):
        config_from_hf(hf | {"sliding_window": 128})


# ---------------------------------------------------------------- config forms


def test_rope_parameters_form_equals_older_keys():
    older = config_to_hf(tiny_config())
    newer = {k: v for k, v in older.items() if k not in ("rope_theta", "rope_scaling")}
    newer["rope_parameters"] = LLAMA3_ROPE | {"rope_theta": 20000.0}
    assert config_from_hf(newer) == config_from_hf(older) == tiny_config()
    default = newer | {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}
    assert config_from_hf(default).rope_theta == 1e6
    assert config_from_hf(default).rope_scaling == {}


def test_dtype_keys_and_eos_list():
    hf = config_to_hf(tiny_config(), dtype=torch.float16)
    assert checkpoint_dtype(hf) == torch.float16
    newer = {k: v for k, v in hf.items() if k != "torch_dtype"} | {"dtype": "bfloat16"}
    assert checkpoint_dtype(newer) == torch.bfloat16
    assert config_from_hf(hf | {"eos_token_id": [7, 2]}).eos_token_id == 7
    assert eos_token_ids(hf | {"eos_token_id": [7, 2]}) == [7, 2]
    assert eos_token_ids(hf) == [2]
    assert config_from_hf(hf | {"head_dim": 16}).head_dim == 16


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_config_round_trip(arch):
    cfg = tiny_config(arch)
    assert config_from_hf(config_to_hf(cfg)) == cfg


# ---------------------------------------------------------------- loading and saving


def test_sharded_index(checkpoint):
    want = logits(load_model(checkpoint), TOKENS)
    tensors = read_safetensors(checkpoint)
    (checkpoint / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2]}
    shards["model-00002-of-00002.safetensors"] = names[1::2]
    for file, shard_names in shards.items():
        save_file({n: tensors[n] for n in shard_names}, str(checkpoint / file))
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    index = {"metadata": {}, "weight_map": weight_map}
    (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
    assert read_safetensors(checkpoint).keys() == tensors.keys()
    assert torch.equal(logits(load_model(checkpoint), TOKENS), want)


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM"])
def test_round_trip_same_logits(tmp_path, arch):
    model = tiny_model(arch)
    save_pretrained(model, tmp_path, dtype=torch.float32)
    loaded = load_model(tmp_path)
    assert torch.equal(logits(loaded, TOKENS), logits(model, TOKENS))
    assert (
        "lm_head.weight" not in read_safetensors(tmp_path) or not model.config.tie_word_embeddings
    )


def test_bfloat16_save_rounds_weights(tmp_path):
    model = tiny_model()
    save_pretrained(model, tmp_path)  # bfloat16 by default
    assert read_config(tmp_path)["torch_dtype"] == "bfloat16"
    loaded = load_model(tmp_path, dtype=torch.float32)
    for (name, p), q in zip(model.named_parameters(), loaded.parameters(), strict=True):
        assert torch.equal(p.to(torch.bfloat16).float(), q), name


@pytest.mark.parametrize("arch", ["LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"])
def test_transformers_reads_saved_checkpoint(tmp_path, arch):
    model = tiny_model(arch)
    save_pretrained(model, tmp_path, dtype=torch.float32)
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        want = reference(TOKENS[None]).logits[0]
    assert (logits(model, TOKENS) - want).abs().max().item() <= 1e-4
