"""The native CPU kernels (models/kernels.c) against the torch operations they replace.

Their attention is tested on the SDPA path's cases in tests/test_attention.py, and a whole
model through them against transformers in tests/test_model_hf.py.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from models import native
from models.llama import LlamaConfig, Rotary, rotate


def test_the_kernels_built_where_there_is_a_compiler():
    if shutil.which("cc") or shutil.which("gcc"):
        assert native.available(), "models/_kernels did not build: see the install's log"


needs_kernels = pytest.mark.skipif(not native.available(), reason="the kernels did not build")


@needs_kernels
@pytest.mark.parametrize("dim", [576, 20, 1])
def test_rms_norm(dim):
    gen = torch.Generator().manual_seed(dim)
    x, w = torch.randn(7, dim, generator=gen) * 3, torch.randn(dim, generator=gen)
    want = F.rms_norm(x, (dim,), w, 1e-5)
    torch.testing.assert_close(native.rms_norm(x, w, 1e-5), want, atol=1e-6, rtol=1e-5)


@needs_kernels
def test_rope_rotates_in_place_through_a_strided_view():
    cfg = LlamaConfig(
        vocab_size=8, hidden_size=64, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2
    )
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(5, 8 * 16, generator=gen)  # q|k|v of 4 + 2 + 2 heads
    cos, sin = Rotary(cfg)(torch.tensor([0, 3, 17, 300, 2047]), torch.float32)
    qk = qkv[:, : 6 * 16].view(5, 6, 16)  # rows 128 floats apart, as split from q|k|v
    want = rotate(qk.clone(), cos, sin)
    v_before = qkv[:, 6 * 16 :].clone()
    out = native.rope_(qk, cos, sin)
    assert out.data_ptr() == qk.data_ptr()
    torch.testing.assert_close(qk, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(qkv[:, 6 * 16 :], v_before)  # v untouched


@needs_kernels
@pytest.mark.parametrize("inter", [1536, 7])
def test_silu_mul(inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = torch.randn(3, 2 * inter, generator=gen) * 8
    want = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(native.silu_mul(gate_up), want, atol=1e-5, rtol=1e-5)


def _argmax_cases(n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(n)
    with_nan = torch.randn(3, n, generator=gen)
    with_nan[1, n // 2] = with_nan[2, -1] = float("nan")
    last_largest = torch.randn(3, n, generator=gen)
    last_largest[:, -1] = 100.0
    return [
        torch.randn(3, n, generator=gen),
        torch.randint(0, 3, (3, n), generator=gen).float(),  # ties: the first one wins
        torch.full((3, n), float("-inf")),
        torch.full((3, n), 2.0),
        with_nan,  # a NaN counts as the largest
        last_largest,  # in the tail past the kernel's whole spans
    ]


@needs_kernels
@pytest.mark.parametrize("n", [1, 5, 16, 63, 64, 65, 200, 49152, 151936])
def test_argmax_equals_torchs_first_largest_value(n):
    for case, x in enumerate(_argmax_cases(n)):
        assert torch.equal(native.argmax(x), x.argmax(-1)), case
    x = torch.randn(2, 4, n)  # any leading shape; a strided view
    assert torch.equal(native.argmax(x[:, 1:]), x[:, 1:].argmax(-1))
