"""Quantized weights at their own width (models/quant.py, models/quant.c).

The codes of each GGUF type give back exactly the values the `gguf` library dequantizes; the
native products equal dequantize-then-multiply in float32 within the bound their activation
quantization implies, on every path this CPU has; a row's result does not depend on the rows
beside it."""

from __future__ import annotations

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

import models.quant
from bench.common import paged_attention
from models import native
from models.attention import CausalAttention
from models.checkpoint import CheckpointError
from models.gguf import packaged_smollm2, served_dequantized
from models.linear import QuantLinear, held_bytes
from models.llama import prepare_for_inference
from models.loader import load_model
from models.quant import (
    CODE_TYPES,
    QK,
    Codes,
    cat,
    codes_of,
    pack_codes,
    packed_rows,
    packed_weight,
)
from tests.engine_util import make_config, running
from tests.tiny import QUANT_MIX, write_gguf, write_model

T = gguf.GGMLQuantizationType
K_SCALES = {T.Q4_K: (0, 4), T.Q6_K: (208, 210)}  # where a K type's float16 scales sit
NATIVE_PATHS = [p for p in ("vnni512", "avx2") if native.available()]


def random_blocks(kind: T, rows: int, inputs: int, seed: int, extreme: bool = False) -> np.ndarray:
    """A tensor's bytes [rows, bytes a row] of `kind`: quantized from random weights where
    the library can, else (K types) random bytes with finite float16 scales. `extreme`: the
    weights (or scales) span from subnormal to near float16's largest."""
    rng = np.random.default_rng(seed)
    if kind not in K_SCALES:
        w = rng.standard_normal((rows, inputs)).astype(np.float32)
        if extreme:  # each block's magnitude its own, 1e-6 .. 1e3
            magnitudes = 10.0 ** rng.uniform(-6, 3, (rows, inputs // QK, 1))
            w = (w.reshape(rows, -1, QK) * magnitudes).reshape(rows, inputs).astype(np.float32)
        return gguf.quants.quantize(w, kind)
    block, size = gguf.GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows, inputs // block, size), dtype=np.uint8)
    start, end = K_SCALES[kind]
    low, high = (-24, 5) if extreme else (-12, -4)
    scales = 2.0 ** rng.uniform(low, high, (rows, inputs // block, (end - start) // 2))
    raw[..., start:end] = scales.astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: T, inputs: int) -> torch.Tensor:
    values = gguf.quants.dequantize(raw, kind)
    return torch.from_numpy(values.copy()).reshape(raw.shape[0], inputs)


@pytest.mark.parametrize("extreme", [False, True])
@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
def test_codes_give_back_the_files_values_exactly(kind, extreme):
    raw = random_blocks(kind, 24, 512, seed=1, extreme=extreme)
    codes = codes_of(raw, kind, 512)
    assert torch.equal(codes.dequantize(), reference(raw, kind, 512))
    assert int(codes.codes.max()) < 2**codes.bits


def bound(x: torch.Tensor, w: torch.Tensor, terms: int = 1) -> torch.Tensor:
    """|y - y_ref| for y = x W^T with x quantized to int8 a row and 32 inputs at a time (each
    input off by at most dx / 2, dx = max|x| / 127 of its block; in two terms, by at most
    dx / 508), plus float32's rounding of the sums (2^-20 of sum |x w| a term, far above
    n * 2^-24 for the sums here)."""
    rows, inputs = x.shape
    dx = x.view(rows, -1, QK).abs().amax(-1) / 127  # [M, I / 32]
    per_block = w.abs().view(w.shape[0], -1, QK).sum(-1)  # [O, I / 32]
    off = dx / 2 if terms == 1 else dx / 508
    return off @ per_block.T + terms * 2**-20 * (x.abs() @ w.abs().T)


def product(codes: Codes, x: torch.Tensor, path: str, monkeypatch, terms: int = 1) -> torch.Tensor:
    monkeypatch.setenv(native.QUANT_PATH_ENV, path)
    assert native.quant_path() == path
    form = codes.form | (models.quant.TWO_TERMS if terms == 2 else 0)
    return native.qlinear(x, pack_codes(codes), codes.shape, form)


def require(path: str) -> None:
    chosen = native._kernels.qpath(native.QUANT_PATHS[path])
    native._kernels.qpath(-1)
    if chosen != native.QUANT_PATHS[path]:
        pytest.skip(f"this CPU has no {path} path")


@pytest.fixture(autouse=True)
def best_path_after():
    """A test that forces a path leaves the best one chosen again."""
    yield
    if native.available():
        native._kernels.qpath(-1)


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("path", NATIVE_PATHS)
@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
@pytest.mark.parametrize("extreme", [False, True])
def test_the_products_equal_dequantize_then_multiply_within_the_bound(
    path, kind, extreme, terms, monkeypatch
):
    require(path)
    raw = random_blocks(kind, 40, 512, seed=2, extreme=extreme)
    codes = codes_of(raw, kind, 512)
    w = codes.dequantize()
    gen = torch.Generator().manual_seed(3)
    for rows in (1, 2, 3, 5, 8, 9, 17, 64):
        x = torch.randn(rows, 512, generator=gen)
        if extreme:  # a few huge inputs among small ones
            x[:, ::37] *= 1e4
        y = product(codes, x, path, monkeypatch, terms)
        assert ((y - x @ w.T).abs() <= bound(x, w, terms)).all(), (rows, kind)


@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_two_terms_are_closer_than_one(path, monkeypatch):
    """The residual's term takes off most of one term's error (of the order of 1/254 of it;
    at least 1/20 here, the float sums' rounding aside)."""
    require(path)
    for kind in CODE_TYPES:
        codes = codes_of(random_blocks(kind, 40, 512, seed=16), kind, 512)
        x = torch.randn(6, 512, generator=torch.Generator().manual_seed(17))
        want = x.double() @ codes.dequantize().double().T
        one, two = (product(codes, x, path, monkeypatch, t) - want for t in (1, 2))
        assert two.abs().mean() < one.abs().mean() / 20, kind


@pytest.mark.parametrize("terms", [1, 2])
@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_a_rows_result_is_the_same_whatever_rows_are_beside_it(path, terms, monkeypatch):
    require(path)
    for kind in CODE_TYPES:
        codes = codes_of(random_blocks(kind, 50, 256, seed=4), kind, 256)
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(5))
        one = [product(codes, x[i : i + 1], path, monkeypatch, terms) for i in range(64)]
        alone = torch.cat(one)
        for rows in (2, 3, 4, 5, 6, 7, 8, 9, 16, 33, 64):
            got = product(codes, x[:rows], path, monkeypatch, terms)
            assert torch.equal(got, alone[:rows]), (kind, rows)


@pytest.mark.parametrize("path", NATIVE_PATHS)
def test_the_paths_agree_with_each_other_up_to_float_rounding(path, monkeypatch):
    """Both paths sum the same integers; only the float32 sums' order may differ."""
    require(path)
    codes = codes_of(random_blocks(T.Q4_1, 33, 512, seed=6), T.Q4_1, 512)
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(7))
    got = product(codes, x, path, monkeypatch)
    monkeypatch.setenv(native.QUANT_PATH_ENV, "auto")
    best = native.qlinear(x, pack_codes(codes), codes.shape, codes.form)
    torch.testing.assert_close(got, best, rtol=1e-5, atol=1e-5)


def test_an_embeddings_rows_come_back_exactly(monkeypatch):
    if not NATIVE_PATHS:
        pytest.skip("the native kernels did not build")
    for kind in CODE_TYPES:
        codes = codes_of(random_blocks(kind, 37, 256, seed=8), kind, 256)
        ids = torch.tensor([[0, 36], [17, 17]])
        rows = native.qrows(ids, pack_codes(codes), codes.shape, codes.form)
        assert torch.equal(rows, codes.dequantize()[ids])


@pytest.mark.parametrize("kind", CODE_TYPES, ids=lambda k: k.name)
def test_a_large_table_packs_in_parts_as_it_would_whole(kind, monkeypatch):
    """packed_rows reads and packs a few outputs at a time: the same bytes as the whole."""
    monkeypatch.setattr(models.quant, "PACK_ROWS", 32)
    raw = random_blocks(kind, 70, 512, seed=15)
    whole = packed_weight(codes_of(raw, kind, 512))
    parts = packed_rows(lambda a, b: raw[a:b], 70, kind, 512)
    assert torch.equal(parts.data, whole.data) and parts.form == whole.form


@pytest.mark.parametrize("kind", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q8_0, T.Q4_K, T.Q6_K])
def test_weights_of_one_type_are_stacked_and_of_two_types_are_not(kind):
    """q|k|v of one type stacked keep their values exactly; of two types, never stacked
    (Qwen's files put a Q4_K q|k beside a Q6_K v; a Q4_0 beside a Q8_0 would read twice
    its bytes widened)."""
    a = codes_of(random_blocks(kind, 16, 256, seed=9), kind, 256)
    b = codes_of(random_blocks(kind, 8, 256, seed=10), kind, 256)
    both = cat([a, b])
    assert both is not None and both.form == a.form
    assert torch.equal(both.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    other = T.Q8_0 if kind != T.Q8_0 else T.Q4_0
    assert cat([a, codes_of(random_blocks(other, 8, 256, seed=11), other, 256)]) is None


@pytest.mark.parametrize("two_terms", [False, True])
def test_parts_without_a_common_form_run_side_by_side(two_terms):
    """A Q4_K q|k beside a Q6_K v (Qwen2.5-Coder's files): each part its own product, the
    outputs side by side, as the parts alone give them, biases each its part's."""
    if not NATIVE_PATHS:
        pytest.skip("the native kernels did not build")
    a = codes_of(random_blocks(T.Q4_K, 48, 256, seed=12), T.Q4_K, 256)
    b = codes_of(random_blocks(T.Q6_K, 20, 256, seed=13), T.Q6_K, 256)
    bias = torch.randn(68)
    product = QuantLinear([packed_weight(a), packed_weight(b)], [48, 20], bias, two_terms)
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(14))
    parts = ((a, bias[:48]), (b, bias[48:]))
    alone = [QuantLinear(c, bias=t, two_terms=two_terms)(x) for c, t in parts]
    assert torch.equal(product(x), torch.cat(alone, -1))


def test_two_terms_where_asked(monkeypatch):
    monkeypatch.delenv(native.ACTIVATIONS_ENV, raising=False)
    assert not native.two_terms()
    monkeypatch.setenv(native.ACTIVATIONS_ENV, "int8x2")
    assert native.two_terms()
    monkeypatch.setenv(native.ACTIVATIONS_ENV, "int4")
    with pytest.raises(ValueError, match="choose int8 or int8x2"):
        native.two_terms()


def test_a_forced_path_the_cpu_lacks_is_refused(monkeypatch):
    monkeypatch.setenv(native.QUANT_PATH_ENV, "sse")
    with pytest.raises(ValueError, match="choose auto or one of"):
        native.quant_path()
    monkeypatch.setenv(native.QUANT_PATH_ENV, "torch")
    assert native.quant_path() == "torch"


# ---------------------------------------------------------------- whole models


def forward_logits(model, ids: list[int], paged: bool = False) -> torch.Tensor:
    """Logits of every position: through dense causal attention, or (paged) through the
    engine's paged cache, where a forward of a few tokens runs the native decoder."""
    tokens = torch.tensor(ids)
    with torch.inference_mode():
        if paged:
            attn, positions = paged_attention(model.config, 1, 0, len(ids))
        else:
            attn, positions = CausalAttention(1, len(ids)), torch.arange(len(ids))
        hidden, _ = model(tokens, positions, attn)
        return model.logits(hidden)


@pytest.fixture(scope="module")
def quantized_and_dequantized(tiny_quant_target):
    models = [load_model(tiny_quant_target, quantized=q) for q in (True, False)]
    for model in models:
        prepare_for_inference(model)
    return models


def test_a_quantized_file_serves_at_its_types(quantized_and_dequantized):
    quantized, dequantized = quantized_and_dequantized
    products = [m for m in quantized.modules() if isinstance(m, QuantLinear)]
    assert len(products) == 4 * quantized.config.num_layers + 2  # and the embedding's table
    assert all(p.terms == 0 for p in products)  # one term, unless asked
    assert not any(isinstance(m, QuantLinear) for m in dequantized.modules())
    assert held_bytes(quantized) < held_bytes(dequantized) / 3


def test_a_quantized_file_gives_the_logits_of_its_dequantized_weights(quantized_and_dequantized):
    """The activations' int8 rounding is all that differs: logits within a few percent of
    their scale, and the same greedy choices (the tiny model's top-2 gaps are wide)."""
    quantized, dequantized = quantized_and_dequantized
    ids = [5, 17, 33, 2, 9, 100, 41, 7, 250, 3]
    want = forward_logits(dequantized, ids)
    for paged in (False, True):
        got = forward_logits(quantized, ids, paged)
        assert (got - want).abs().max() < 0.03 * want.abs().max()
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_the_native_decoder_runs_a_quantized_model(quantized_and_dequantized):
    """A few tokens through the paged cache take the native decoder, whose products are the
    same kernels the layer-by-layer path calls."""
    quantized, _ = quantized_and_dequantized
    assert quantized.decoder is not None
    ids = [5, 17, 33, 2, 9]
    torch.testing.assert_close(
        forward_logits(quantized, ids, paged=True),
        forward_logits(quantized, ids),
        atol=2e-4,
        rtol=0,
    )


def test_a_layer_of_parts_runs_through_the_native_decoder(tmp_path):
    """q|k in Q4_K beside v in Q6_K: the layer's q|k|v a product of parts, in the native
    decoder's table as in the layer-by-layer path."""
    source = write_model(tmp_path / "hf", layers=1, hidden=256, head_dim=64, seed=4)
    kinds = {"attn_q": T.Q4_K, "attn_k": T.Q4_K, "attn_v": T.Q6_K}
    model = load_model(write_gguf(source, tmp_path / "parts.gguf", kinds), quantized=True)
    prepare_for_inference(model)
    assert [p.shape[0] for p in model.layers[0].self_attn.qkv.parts] == [256 + 128, 128]
    assert model.decoder is not None
    ids = [5, 17, 33, 2, 9]
    torch.testing.assert_close(
        forward_logits(model, ids, paged=True), forward_logits(model, ids), atol=2e-4, rtol=0
    )


def test_the_torch_path_serves_the_same_model(tiny_quant_target, monkeypatch):
    """Forced to torch's path, the weights stay codes and each product dequantizes: the
    reference the kernels approximate."""
    monkeypatch.setenv(native.QUANT_PATH_ENV, "torch")
    model = load_model(tiny_quant_target, quantized=True)
    prepare_for_inference(model)
    dequantized = load_model(tiny_quant_target)
    prepare_for_inference(dequantized)
    assert all(m.packed is None for m in model.modules() if isinstance(m, QuantLinear))
    ids = [5, 17, 33, 2, 9, 100]
    torch.testing.assert_close(
        forward_logits(model, ids), forward_logits(dequantized, ids), atol=1e-4, rtol=1e-4
    )


# ---------------------------------------------------------------- files we cannot serve


def test_a_truncated_or_corrupt_file_is_refused_by_name(tiny_quant_target, tmp_path):
    data = tiny_quant_target.read_bytes()
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(data[: len(data) - 1000])
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(data[:8] + bytes(range(256)) * 4 + data[8 + 1024 :])
    for path in (truncated, corrupt):
        with pytest.raises(CheckpointError, match=str(path.name)):
            load_model(path, quantized=True)


def test_a_tensor_of_a_type_we_cannot_read_is_refused_by_name(tiny_target, tmp_path):
    path = write_gguf(tiny_target, tmp_path / "q8_1.gguf", QUANT_MIX | {"blk.1.ffn_down": T.Q8_1})
    with pytest.raises(CheckpointError, match=r"q8_1.gguf: tensor blk.1.ffn_down.weight .*Q8_1"):
        load_model(path, quantized=True)


def test_a_type_without_codes_is_served_dequantized_and_named(tiny_target, tmp_path):
    path = write_gguf(tiny_target, tmp_path / "iq4.gguf", QUANT_MIX | {"blk.0.ffn_down": T.IQ4_NL})
    assert served_dequantized(path) == ["blk.0.ffn_down.weight (IQ4_NL)"]
    model = load_model(path, quantized=True)
    assert not isinstance(model.layers[0].mlp.down_proj, QuantLinear)
    assert isinstance(model.layers[1].mlp.down_proj, QuantLinear)


async def test_the_start_log_and_metrics_say_how_the_weights_are_served(
    tiny_target, tmp_path, caplog
):
    path = write_gguf(tiny_target, tmp_path / "iq4.gguf", QUANT_MIX | {"blk.0.ffn_down": T.IQ4_NL})
    caplog.set_level("INFO", logger="tandem.engine")
    async with running(make_config(path)) as engine:
        products = f"quantized/{native.quant_path()}"
        assert engine.metrics.registry.value("tandem_products", products=products) == 1
    assert f"the target's products: {products}" in caplog.text
    assert "served dequantized (no kernel for their types): blk.0.ffn_down.weight (IQ4_NL)" in (
        caplog.text
    )


LOAD_PEAK = """
import resource, sys, torch
import models.gguf, models.llama, models.loader
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
model = models.loader.load_model(sys.argv[1], quantized=True)
models.llama.prepare_for_inference(model)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)
"""


@pytest.mark.slow
def test_loading_smollm2_streams_its_file():
    """The peak resident growth while loading and preparing the shipped file stays within
    the file's size plus 300 MB (the loader once built a float32 copy first)."""
    path = packaged_smollm2()
    out = subprocess.run(
        [sys.executable, "-c", LOAD_PEAK, str(path)], capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[-1]) <= path.stat().st_size + 300 * 2**20
