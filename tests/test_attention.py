"""The CPU paged attention (its SDPA path and its native kernel) against a dense float64
reference, and KVCache.move.

Each case builds page tables through the allocator (pages handed out in a shuffled order, so a
sequence's pages are not contiguous), fills the cache with noise (a read of a wrong slot shows),
writes each sequence's existing context, then runs two layers of new tokens through
`paged_metadata` + `TorchPagedAttention`. The reference sees each sequence's keys in logical
order and computes softmax(q k^T / sqrt(d) + mask) v in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from kv.cache import KVCache
from kv.table import PageTable
from models import native
from models.attention import TorchPagedAttention
from tests.attention_cases import CASES, NUM_PAGES, Batch, Seq
from tests.paged import shuffled_allocator

LAYERS, HEAD_DIM = 2, 16  # the native kernel takes whole 16-float vectors a head


@pytest.fixture(autouse=True, params=["sdpa", "native"])
def path(request, monkeypatch):
    """Every case through both paths of TorchPagedAttention."""
    if request.param == "sdpa":
        monkeypatch.setattr(TorchPagedAttention, "native_max_q", 0)
    elif not native.available():
        pytest.skip("the native kernels did not build (tests/test_native.py says why)")
    else:
        monkeypatch.setattr(TorchPagedAttention, "native_max_q", 1 << 30)
    return request.param


def reference(q, keys, values, mask):
    """q [Q, Hq, D], keys/values [L, Hkv, D], mask [Q, L] -> [Q, Hq, D] in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


def write_context(cache: KVCache, batch: Batch, keys: torch.Tensor, values: torch.Tensor):
    """Store each sequence's first `context` keys/values ([layers, sum kv_len, Hkv, D])."""
    start = 0
    for table, seq in zip(batch.tables, batch.seqs, strict=True):
        rows = cache.key_rows(torch.tensor(table.slots(0, seq.context), dtype=torch.long))
        context = slice(start, start + seq.context)
        for layer in range(cache.data.shape[0]):
            store = cache.layer_rows(layer)
            store[rows] = keys[layer, context].to(store.dtype)
            store[rows + cache.page_size] = values[layer, context].to(store.dtype)
        start += seq.kv_len


def run_case(
    seqs: list[Seq],
    page_size: int,
    num_q_heads: int,
    num_kv_heads: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
):
    """`dtype`: the cache's; the reference reads the keys and values as it keeps them."""
    gen = torch.Generator().manual_seed(seed)
    batch = Batch(seqs, page_size, seed)
    cache = KVCache(
        LAYERS, NUM_PAGES, page_size, num_kv_heads, HEAD_DIM, dtype, queries=torch.float32
    )
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen) * 10)  # noise
    # every sequence's keys in logical order, context then this forward's tokens
    shape = (LAYERS, sum(s.kv_len for s in seqs), num_kv_heads, HEAD_DIM)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    keys, values = keys.to(dtype).float(), values.to(dtype).float()  # exact in the cache
    write_context(cache, batch, keys, values)
    bounds = [0] + [s.kv_len for s in seqs]
    bounds = torch.tensor(bounds).cumsum(0).tolist()
    new = [j for b, s in enumerate(seqs) for j in range(bounds[b] + s.context, bounds[b + 1])]

    attn = TorchPagedAttention(batch.metadata(), cache, num_q_heads)
    assert (attn.kernel is not None) == (TorchPagedAttention.native_max_q > 0)
    written = cache.key_rows(torch.tensor(batch.slots))
    for layer in range(LAYERS):
        q = torch.randn(batch.num_tokens, num_q_heads, HEAD_DIM, generator=gen)
        out = attn(layer, q, keys[layer, new], values[layer, new])
        assert out.shape == q.shape
        q_start = 0
        for b, seq in enumerate(seqs):
            kv = slice(bounds[b], bounds[b + 1])
            rows = slice(q_start, q_start + seq.q_len)
            want = reference(q[rows], keys[layer, kv], values[layer, kv], seq.mask())
            torch.testing.assert_close(out[rows].double(), want, atol=1e-5, rtol=1e-5)
            q_start += seq.q_len
        store = cache.layer_rows(layer).float()
        assert torch.equal(store[written], keys[layer, new])
        assert torch.equal(store[written + page_size], values[layer, new])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_dense_reference(case, page_size, dtype):
    seed = len(case) + page_size
    run_case(CASES[case], page_size, num_q_heads=4, num_kv_heads=2, seed=seed, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads", [(3, 3), (6, 1)])
def test_head_groupings(heads, dtype):
    run_case(CASES["verify"] + CASES["decode"][:2], 4, *heads, seed=5, dtype=dtype)
    run_case(CASES["tree"], 4, *heads, seed=6, dtype=dtype)


@pytest.mark.parametrize("page_size", [1, 4])
def test_move_copies_every_layer_across_pages(page_size):
    gen = torch.Generator().manual_seed(page_size)
    cache = KVCache(3, 24, page_size, 2, 3)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen))
    table = PageTable(page_size)
    table.grow(shuffled_allocator(24, page_size), 20)
    # a tree's accepted path: prefix of 3, nodes 0, 2, 5 of the tree move to logical 3, 4, 5;
    # destinations overlap the sources (node 2 sits where node 5 goes)
    src = torch.tensor(table.slots(3, 4) + table.slots(5, 6) + table.slots(8, 9))
    dst = torch.tensor(table.slots(3, 6))
    assert len({s // page_size for s in src.tolist() + dst.tolist()}) > 1
    before = cache.data.clone()
    cache.move(src, dst)

    expected = before.clone()
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        expected[:, d // page_size, :, d % page_size] = before[:, s // page_size, :, s % page_size]
    assert torch.equal(cache.data, expected)
