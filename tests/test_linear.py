"""Inference projections: fused and prepacked linears give the plain model's outputs."""

from __future__ import annotations

import copy

import pytest
import torch

from models import native
from models.attention import CausalAttention
from models.linear import Int8Linear, PackedLinear
from models.llama import LlamaConfig, LlamaModel, prepare_for_inference

CFG = LlamaConfig(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=96,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    attention_bias=True,
)


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 16, 33])
def test_packed_linear_equals_the_fused_products(rows):
    linears = [torch.nn.Linear(64, n, bias=b) for n, b in ((32, True), (16, False), (8, True))]
    fused = PackedLinear(linears)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        for got, lin in zip(fused.split(x), linears, strict=True):
            torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=1e-5)


def test_a_large_weight_takes_one_row_through_onednn_too(monkeypatch):
    import models.linear as linear_module

    monkeypatch.setattr(linear_module, "PACKED_ONE_ROW_BYTES", 64 * 200 * 4)
    small, large = torch.nn.Linear(64, 100), torch.nn.Linear(64, 200)
    packed = [PackedLinear([small]), PackedLinear([large])]
    assert [p.one_row_packed for p in packed] == [False, True]
    x = torch.randn(1, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed[1](x), large(x), atol=1e-5, rtol=1e-5)


def test_prepared_model_matches_the_plain_forward():
    model = LlamaModel(CFG).eval()
    prepared = copy.deepcopy(model)
    prepare_for_inference(prepared)
    assert prepared.layers[0].self_attn.qkv is not None
    assert set(prepared.state_dict()) == set(model.state_dict())  # checkpoint names kept
    ids = torch.randint(CFG.vocab_size, (12,))
    positions = torch.arange(12)
    with torch.inference_mode():
        want, _ = model(ids, positions, CausalAttention(1, 12))
        got, _ = prepared(ids, positions, CausalAttention(1, 12))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(prepared.logits(got), model.logits(want), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 5])
def test_int8_linear_is_within_its_rounding_of_the_float_product(rows):
    linears = [torch.nn.Linear(64, 48, bias=True), torch.nn.Linear(64, 16, bias=False)]
    packed = PackedLinear(linears)
    int8 = Int8Linear(packed)
    assert int8.scales.shape == (64,)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = torch.cat([lin(x) for lin in linears], -1)
        got = int8(x)
    # each weight is off by at most half a step (scale / 2) of its row
    bound = 0.5 * x.abs().sum(-1, keepdim=True) * int8.scales[None, :] + 1e-5
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # int8 rounds: the check is not of the float path
    assert [g.shape[-1] for g in int8.split(x)] == [48, 16]


def test_an_int8_model_keeps_its_tied_embedding_float():
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
    model = LlamaModel(cfg).eval()
    prepare_for_inference(model, int8=True)
    assert isinstance(model.lm_head, Int8Linear) and isinstance(
        model.layers[0].mlp.gate_up, Int8Linear
    )
    assert model.embed_tokens.weight.dtype == torch.float32
    if native.available():  # short forwards through the kernels' int8 products
        assert model.decoder is not None
