"""Our loader and paged forward against Hugging Face transformers on its own checkpoints."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import transformers

from models import native
from models.attention import CausalAttention
from models.checkpoint import read_config, read_safetensors
from models.llama import prepare_for_inference
from models.loader import checkpoint_dtype, load_model
from tests.paged import PagedRunner

VOCAB = 96
TOLERANCE = 1e-4
COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,  # puts one of head_dim 16's frequencies in the band
}


def hf_config(arch: str) -> transformers.PretrainedConfig:
    if arch == "llama":
        # the older keys, which transformers 4.x and 5.x both take
        rope: dict[str, Any] = {"rope_scaling": LLAMA3_ROPE, "rope_theta": 50000.0}
        return transformers.LlamaConfig(**COMMON, **rope)
    if arch == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    return transformers.MistralConfig(**COMMON, head_dim=24, sliding_window=None)


def hf_model(arch: str) -> transformers.PreTrainedModel:
    """A random model whose every weight (norms and biases too) matters to the logits."""
    model = transformers.AutoModelForCausalLM.from_config(hf_config(arch))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
    return model.eval()


def hf_logits(model: transformers.PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of one sequence."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def random_chunks(lengths: list[int]) -> list[list[int]]:
    return [torch.randint(0, VOCAB, (n,)).tolist() for n in lengths]


@pytest.mark.parametrize("prepared", [False, True], ids=["plain", "inference-kernels"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral"])
def test_paged_prefill_decode_verify_match_transformers(tmp_path, arch, prepared):
    """Plain modules, and the engine's default kernels (fused packed linears; the native
    norms, rotary, silu and attention where they built)."""
    reference = hf_model(arch)
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    if prepared:
        prepare_for_inference(model)
    runner = PagedRunner(model, num_seqs=3)
    # ragged prefill (lengths end mid-page), three batched decodes, two verify chunks
    schedule = [[7, 3, 10]] + [[1, 1, 1]] * 3 + [[3, 5, 4], [5, 4, 3]]
    outputs: list[tuple[int, int, torch.Tensor]] = []  # (sequence, first position, logits)
    for lengths in schedule:
        starts = [len(t) for t in runner.tokens]
        logits = runner.step(random_chunks(lengths))
        outputs.extend(zip(range(3), starts, logits, strict=True))
    expected = [hf_logits(reference, tokens) for tokens in runner.tokens]
    for seq, start, got in outputs:
        want = expected[seq][start : start + len(got)]
        assert (got - want).abs().max().item() <= TOLERANCE, (arch, seq, start)
    assert expected[0].abs().max() > 1.0  # the check is not vacuous


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_token_forwards_through_the_native_decoder_match_transformers(tmp_path, arch):
    """One sequence, so every decode is a one-token forward: OneTokenDecoder's path."""
    reference = hf_model(arch)
    reference.save_pretrained(tmp_path)
    model = load_model(tmp_path)
    prepare_for_inference(model)
    if native.available():
        assert model.decoder is not None
    runner = PagedRunner(model, num_seqs=1)
    outputs = [(len(runner.tokens[0]), runner.step(random_chunks([n]))[0]) for n in [9, 1, 1, 1]]
    expected = hf_logits(reference, runner.tokens[0])
    for start, got in outputs:
        want = expected[start : start + len(got)]
        assert (got - want).abs().max().item() <= TOLERANCE, (arch, start)


def test_tied_embeddings_stay_tied(tmp_path):
    hf_model("qwen2").save_pretrained(tmp_path)
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())


def test_bfloat16_checkpoint_loads_as_float32(tmp_path):
    hf_model("llama").to(torch.bfloat16).save_pretrained(tmp_path)
    assert checkpoint_dtype(read_config(tmp_path)) == torch.bfloat16
    assert read_safetensors(tmp_path)["model.norm.weight"].dtype == torch.bfloat16
    model = load_model(tmp_path, dtype=torch.float32)
    # a fresh float32 load: converting the bf16 model back would keep its bf16 rotary buffer
    reference = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    assert all(p.dtype == torch.float32 for p in model.parameters())
    tokens = torch.randint(0, VOCAB, (12,))
    with torch.no_grad():
        hidden, _ = model(tokens, torch.arange(12), CausalAttention(1, 12))
        got = model.logits(hidden)
    want = hf_logits(reference, tokens.tolist())
    assert (got - want).abs().max().item() <= TOLERANCE
