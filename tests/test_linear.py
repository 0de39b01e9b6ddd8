"""Inference projections: fused linears, each weight held once, give the plain model's
outputs for every row count."""

from __future__ import annotations

import copy

import pytest
import torch

from models import native
from models.attention import CausalAttention
from models.linear import FusedLinear, TiedEmbedding, held_bytes
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


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 16, 33, 64, 65, 200])
def test_fused_linear_equals_the_fused_products(rows):
    """Row counts across the kernels' 8-row tiles and 64-row chunks."""
    linears = [torch.nn.Linear(64, n, bias=b) for n, b in ((32, True), (16, False), (8, True))]
    fused = FusedLinear(linears)
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        for got, lin in zip(fused.split(x), linears, strict=True):
            torch.testing.assert_close(got, lin(x), atol=1e-5, rtol=1e-5)
        if fused.blocked is not None:  # the kernels' product: a row's result is its own
            assert torch.equal(fused(x[-1:]), fused(x)[-1:])


def test_the_weight_is_held_once_in_the_layout_its_product_reads():
    linear = torch.nn.Linear(64, 40)
    fused = FusedLinear([linear])
    if native.available():
        assert fused.weight is None and fused.blocked is not None
        assert fused.blocked.shape == (3, 64, 16)  # 40 outputs padded to 3 blocks of 16
    else:
        assert fused.blocked is None and fused.weight is not None


@pytest.mark.parametrize("rows", [1, 5, 13, 70])
def test_int8_linear_is_within_its_rounding_of_the_float_product(rows):
    linears = [torch.nn.Linear(64, 48, bias=True), torch.nn.Linear(64, 16, bias=False)]
    int8 = FusedLinear(linears, int8=True)
    scales = int8.scales[:64]  # padded to whole blocks where blocked
    x = torch.randn(rows, 64)
    with torch.inference_mode():
        want = torch.cat([lin(x) for lin in linears], -1)
        got = int8(x)
    # each weight is off by at most half a step (scale / 2) of its row
    bound = 0.5 * x.abs().sum(-1, keepdim=True) * scales[None, :] + 1e-5
    assert ((got - want).abs() <= bound).all()
    assert (got - want).abs().max() > 0  # int8 rounds: the check is not of the float path
    assert [g.shape[-1] for g in int8.split(x)] == [48, 16]
    if int8.blocked is not None:  # a row's result is its own, whichever tile converted
        with torch.inference_mode():
            assert torch.equal(int8(x[:1]), got[:1]) and torch.equal(int8(x[-1:]), got[-1:])


@pytest.mark.parametrize("tied", [False, True])
def test_prepared_model_matches_the_plain_forward(tied):
    model = LlamaModel(LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": tied})).eval()
    prepared = copy.deepcopy(model)
    prepare_for_inference(prepared)
    attn = prepared.layers[0].self_attn
    assert attn.qkv is not None and attn.q_proj is None  # the originals dropped
    assert isinstance(prepared.embed_tokens, TiedEmbedding) == tied
    ids = torch.randint(CFG.vocab_size, (12,))
    positions = torch.arange(12)
    with torch.inference_mode():
        want, _ = model(ids, positions, CausalAttention(1, 12))
        got, _ = prepared(ids, positions, CausalAttention(1, 12))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(prepared.logits(got), model.logits(want), atol=1e-4, rtol=1e-4)


def test_a_prepared_model_holds_each_weight_once():
    """Every byte the prepared model keeps (parameters, buffers, the products' weights) is one
    of the plain model's parameters (the tied table counted once), the rotary's buffer, or
    the blocks' zero padding."""
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
    model = LlamaModel(cfg).eval()
    plain = held_bytes(model)
    params = sum(p.numel() for p in model.parameters())  # the tied table once
    assert plain == 4 * (params + model.rotary.inv_freq.numel())
    prepare_for_inference(model)
    fused = [sub for sub in model.modules() if isinstance(sub, FusedLinear)]
    blocked = [sub.blocked for sub in fused if sub.blocked is not None]
    padding = sum(w.numel() for w in blocked) - sum(
        sub.out_features * sub.in_features for sub in fused if sub.blocked is not None
    )
    assert held_bytes(model) == plain + 4 * padding


def test_an_int8_model_keeps_its_tied_embedding_float():
    cfg = LlamaConfig(**{**CFG.__dict__, "tie_word_embeddings": True})
    model = LlamaModel(cfg).eval()
    prepare_for_inference(model, int8=True)
    assert isinstance(model.lm_head, FusedLinear) and model.lm_head.scales is not None
    assert model.layers[0].mlp.gate_up.scales is not None
    assert model.embed_tokens.weight.dtype == torch.float32
    if native.available():  # short forwards through the kernels' int8 products
        assert model.decoder is not None
