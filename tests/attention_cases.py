"""Attention test cases: sequences of existing context and new tokens (chains and trees) over
shuffled pages, as the CPU and GPU attention tests use them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.attention_metadata import AttentionMetadata
from kv.table import PageTable, build_csr
from models.attention import paged_metadata
from tests.paged import shuffled_allocator

NUM_PAGES = 160  # enough for every case at page size 1


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
