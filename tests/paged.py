"""Run a model step by step through the paged KV cache (test helper)."""

from __future__ import annotations

import random

import torch

from kv.cache import KVCache
from kv.pages import PageAllocator
from kv.table import PageTable, build_csr
from models.attention import AttentionBackend, TorchPagedAttention, paged_metadata
from models.llama import LlamaModel


class PagedRunner:
    """Runs steps of a batch through the paged cache, pages handed out in a shuffled order."""

    def __init__(
        self,
        model: LlamaModel,
        num_seqs: int,
        page_size: int = 4,
        num_pages: int = 48,
        attention: AttentionBackend = TorchPagedAttention,
    ):
        cfg = model.config
        self.model = model
        self.attention = attention
        self.cache = KVCache(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim)
        self.free = torch.randperm(num_pages).tolist()
        self.tables = [PageTable(page_size) for _ in range(num_seqs)]
        self.tokens: list[list[int]] = [[] for _ in range(num_seqs)]

    def step(self, chunks: list[list[int]], aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor]:
        """Append chunk b to sequence b; the logits of each chunk's tokens [len(chunk), vocab]
        (and in `self.aux` the outputs of `aux_layers` over the step's tokens)."""
        starts = [len(t) for t in self.tokens]
        for table, tokens, chunk in zip(self.tables, self.tokens, chunks, strict=True):
            tokens.extend(chunk)
            while table.capacity < len(tokens):
                table.pages.append(self.free.pop())
        kv_lens = [len(t) for t in self.tokens]
        csr = build_csr(self.tables, kv_lens, [len(c) for c in chunks])
        spans = [range(s, s + len(c)) for s, c in zip(starts, chunks, strict=True)]
        positions = [p for span in spans for p in span]
        slots = [t.slot(p) for t, span in zip(self.tables, spans, strict=True) for p in span]

        def ints(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int32)

        meta = paged_metadata(
            ints(csr.qo_indptr),
            ints(csr.kv_indptr),
            ints(csr.kv_indices),
            ints(csr.kv_last_page_len),
            ints(positions),
            ints(slots),
            page_size=self.cache.page_size,
            max_q=max(len(c) for c in chunks),
            max_kv=max(kv_lens),
        )
        attn = self.attention(meta, self.cache, self.model.config.num_heads)
        ids = torch.tensor([t for c in chunks for t in c])
        with torch.no_grad():
            hidden, self.aux = self.model(ids, ints(positions), attn, aux_layers)
            logits = self.model.logits(hidden)  # [T, vocab]
        return list(logits.split([len(c) for c in chunks]))


def shuffled_allocator(num_pages: int, seed: int) -> PageAllocator:
    """An allocator whose free list is in a random order (pages come out non-contiguous)."""
    allocator = PageAllocator(num_pages)
    pages = allocator.alloc(num_pages)
    random.Random(seed).shuffle(pages)
    allocator.free(pages)
    return allocator
