"""The torch paged attention against a dense float64 reference, and KVCache.move.

Each case builds page tables through the allocator (pages handed out in a shuffled order, so a
sequence's pages are not contiguous), fills the cache with noise (a read of a wrong slot shows),
writes each sequence's existing context, then runs two layers of new tokens through
`paged_metadata` + `TorchPagedAttention`. The reference sees each sequence's keys in logical
order and computes softmax(q k^T / sqrt(d) + mask) v in float64.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import pytest
import torch

from kv.cache import KVCache
from kv.pages import PageAllocator
from kv.table import PageTable, build_csr
from models.attention import AttentionMetadata, TorchPagedAttention, paged_metadata

LAYERS, HEAD_DIM, NUM_PAGES = 2, 8, 160


@dataclass
class Seq:
    context: int  # keys already in the cache
    q_len: int  # tokens of this forward, written at slots context .. context + q_len - 1
    parents: list[int] | None = None  # tree: parent of each new token (-1: the last context key)

    @property
    def kv_len(self) -> int:
        return self.context + self.q_len

    def positions(self) -> list[int]:
        if self.parents is None:
            return list(range(self.context, self.kv_len))
        depth: list[int] = []
        for parent in self.parents:
            depth.append(0 if parent < 0 else depth[parent] + 1)
        return [self.context + d for d in depth]

    def mask(self) -> torch.Tensor:
        """[q_len, kv_len] bool: causal by position, or prefix + ancestors for a tree."""
        if self.parents is None:
            keys = torch.arange(self.kv_len)
            return keys[None, :] <= torch.tensor(self.positions())[:, None]
        tree = torch.zeros(self.q_len, self.q_len, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                tree[i] = tree[parent]
            tree[i, i] = True
        return torch.cat((torch.ones(self.q_len, self.context, dtype=torch.bool), tree), dim=1)


def shuffled_allocator(num_pages: int, seed: int) -> PageAllocator:
    """An allocator whose free list is in a random order (pages come out non-contiguous)."""
    allocator = PageAllocator(num_pages)
    pages = allocator.alloc(num_pages)
    random.Random(seed).shuffle(pages)
    allocator.free(pages)
    return allocator


def reference(q, keys, values, mask):
    """q [Q, Hq, D], keys/values [L, Hkv, D], mask [Q, L] -> [Q, Hq, D] in float64."""
    group = q.shape[1] // keys.shape[1]
    k = keys.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, L, D]
    v = values.double().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = q.double().transpose(0, 1) @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return (scores.softmax(dim=-1) @ v).transpose(0, 1)


class Batch:
    """Page tables (pages in a shuffled order), CSR and slots of one forward over `seqs`."""

    def __init__(self, seqs: list[Seq], page_size: int, seed: int):
        self.seqs, self.page_size = seqs, page_size
        allocator = shuffled_allocator(NUM_PAGES, seed)
        self.tables = [PageTable(page_size) for _ in seqs]
        for table, seq in zip(self.tables, seqs, strict=True):
            table.grow(allocator, seq.kv_len)
        self.csr = build_csr(self.tables, [s.kv_len for s in seqs], [s.q_len for s in seqs])
        self.slots = [  # where this forward's tokens write
            slot
            for table, seq in zip(self.tables, seqs, strict=True)
            for slot in table.slots(seq.context, seq.kv_len)
        ]
        self.num_tokens = len(self.slots)
        self.trees = any(s.parents is not None for s in seqs)

    def csr_tensors(self) -> list[torch.Tensor]:
        c = self.csr
        lists = (c.qo_indptr, c.kv_indptr, c.kv_indices, c.kv_last_page_len)
        return [torch.tensor(x, dtype=torch.int32) for x in lists]

    def padded_mask(self) -> torch.Tensor | None:
        """[B, max_q, max_kv] bool for a batch of trees, else None (the causal rule)."""
        if not self.trees:
            return None
        max_q, max_kv = max(s.q_len for s in self.seqs), max(s.kv_len for s in self.seqs)
        mask = torch.zeros(len(self.seqs), max_q, max_kv, dtype=torch.bool)
        for b, seq in enumerate(self.seqs):
            mask[b, : seq.q_len, : seq.kv_len] = seq.mask()
        return mask

    def metadata(self, device: str = "cpu") -> AttentionMetadata:
        mask = self.padded_mask()
        return paged_metadata(
            *(t.to(device) for t in self.csr_tensors()),
            torch.tensor([p for s in self.seqs for p in s.positions()], device=device),
            torch.tensor(self.slots, device=device),
            self.page_size,
            max(s.q_len for s in self.seqs),
            max(s.kv_len for s in self.seqs),
            None if mask is None else mask.to(device),
        )


def write_context(cache: KVCache, batch: Batch, keys: torch.Tensor, values: torch.Tensor):
    """Store each sequence's first `context` keys/values ([layers, sum kv_len, Hkv, D])."""
    start = 0
    for table, seq in zip(batch.tables, batch.seqs, strict=True):
        rows = cache.key_rows(torch.tensor(table.slots(0, seq.context), dtype=torch.long))
        context = slice(start, start + seq.context)
        for layer in range(cache.data.shape[0]):
            cache.layer_rows(layer)[rows] = keys[layer, context]
            cache.layer_rows(layer)[rows + cache.page_size] = values[layer, context]
        start += seq.kv_len


def run_case(seqs: list[Seq], page_size: int, num_q_heads: int, num_kv_heads: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    batch = Batch(seqs, page_size, seed)
    cache = KVCache(LAYERS, NUM_PAGES, page_size, num_kv_heads, HEAD_DIM)
    cache.data.copy_(torch.randn(cache.data.shape, generator=gen) * 10)  # noise
    # every sequence's keys in logical order, context then this forward's tokens
    shape = (LAYERS, sum(s.kv_len for s in seqs), num_kv_heads, HEAD_DIM)
    keys, values = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
    write_context(cache, batch, keys, values)
    bounds = [0] + [s.kv_len for s in seqs]
    bounds = torch.tensor(bounds).cumsum(0).tolist()
    new = [j for b, s in enumerate(seqs) for j in range(bounds[b] + s.context, bounds[b + 1])]

    attn = TorchPagedAttention(batch.metadata(), cache, num_q_heads)
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
        store = cache.layer_rows(layer)
        assert torch.equal(store[written], keys[layer, new])
        assert torch.equal(store[written + page_size], values[layer, new])


CASES = {
    # ragged prompts, no context; lengths end mid-page and on page boundaries
    "prefill": [Seq(0, 5), Seq(0, 17), Seq(0, 1), Seq(0, 32)],
    # one query per sequence; the first token of a fresh page (context 16) included
    "decode": [Seq(20, 1), Seq(3, 1), Seq(47, 1), Seq(16, 1), Seq(0, 1)],
    # several queries over existing context, lengths differing across the batch
    "verify": [Seq(9, 4), Seq(30, 5), Seq(16, 2), Seq(1, 5)],
    # every sequence with the same number of queries: no padding in the query layout
    "verify_even": [Seq(9, 4), Seq(30, 4), Seq(16, 4)],
    "mixed": [Seq(0, 13), Seq(21, 1), Seq(6, 4)],
    # prefix visible, tree part by ancestry; positions are context + depth
    "tree": [
        Seq(7, 6, parents=[-1, 0, 0, 1, 1, 2]),
        Seq(18, 3, parents=[-1, 0, 1]),
        Seq(15, 4, parents=[-1, -1, 0, 1]),
    ],
    "tree_even": [Seq(7, 4, parents=[-1, 0, 0, 1]), Seq(20, 4, parents=[-1, 0, 1, 2])],
}


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_paged_attention_matches_dense_reference(case, page_size):
    run_case(CASES[case], page_size, num_q_heads=4, num_kv_heads=2, seed=len(case) + page_size)


@pytest.mark.parametrize("heads", [(3, 3), (6, 1)])
def test_head_groupings(heads):
    run_case(CASES["verify"] + CASES["decode"][:2], 4, *heads, seed=5)
    run_case(CASES["tree"], 4, *heads, seed=6)


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
