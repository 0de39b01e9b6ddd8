"""Attention backends over the paged KV cache.

A backend object is built once per forward from the step's `AttentionMetadata` and called by
every layer with that layer's q, k, v. It writes the new keys and values into the cache and
attends over each sequence's keys. The torch backend runs everywhere and is the default;
FlashInfer's (models/flashinfer_backend.py) can be chosen on CUDA (`--attention flashinfer`).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from core.attention_metadata import AttentionMetadata
from kv.cache import KVCache
from models import native


class Attention(Protocol):
    """Called by layer `layer` with q [T, Hq, D], k and v [T, Hkv, D]; returns [T, Hq, D]."""

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


class AttentionBackend(Protocol):
    """Builds one forward's Attention over a cache from the forward's metadata. The builder
    chooses one backend at start-up (engine/builder.py) and hands it to every stage that runs
    a forward; TorchPagedAttention is one."""

    def __call__(self, meta: AttentionMetadata, cache: KVCache, num_q_heads: int) -> Attention: ...


class TorchPagedAttention:
    """Paged attention with torch ops: gather each sequence's keys, one SDPA call per layer.

    Everything that does not depend on the layer (rows to write and read, the mask, the gather
    buffer) is built once here; a layer call is two row writes, one gather of its keys and
    values, and SDPA.
    """

    # forwards of at most this many queries a sequence (decodes, verifies, trees) attend
    # through the native kernel where it built, reading keys where the cache keeps them;
    # longer ones (prefill chunks) through SDPA, whose blocked products are faster there
    native_max_q = 64

    def __init__(self, meta: AttentionMetadata, cache: KVCache, num_q_heads: int):
        self.meta = meta
        self.cache = cache
        ps = cache.page_size
        write = cache.key_rows(meta.slot_mapping)  # [T]
        self.kernel: native.PagedAttention | None = None
        usable = native.attention_usable(cache.data, cache.head_dim, cache.queries)
        if meta.max_q <= self.native_max_q and usable:
            self.kernel = native.PagedAttention(
                ps,
                write,
                self._key_rows(meta, cache),
                meta.kv_lens,
                meta.q_index,
                meta.q_positions,
                meta.mask,
            )
            return
        self.write_rows = (write, write + ps)  # key and value rows
        self.read_rows, self.kv = self._reads(meta, cache)
        group = num_q_heads // cache.num_kv_heads
        b, qmax, lmax = meta.num_seqs, meta.max_q, meta.kv_slots.shape[1]
        visible = meta.visible()  # [B, Qmax, Lmax]
        # queries are laid out [B, Hkv, group * Qmax, D]; each group repeats the query rows
        # (with one query a sequence, the mask's one row broadcasts to them)
        self.mask = visible[:, None]
        if qmax > 1:
            self.mask = visible[:, None, None].expand(b, 1, group, qmax, lmax)
            self.mask = self.mask.reshape(b, 1, group * qmax, lmax)
        self.group = group
        # tokens come sequence by sequence (CSR order), so when every sequence has Qmax of them
        # the padded layout is the token order itself and needs no scatter or gather
        self.dense = meta.q_index.shape[0] == b * qmax

    @staticmethod
    def _key_rows(meta: AttentionMetadata, cache: KVCache) -> torch.Tensor:
        """[B, Lmax] row of each key in a layer's rows: shared by every forward over the same
        keys of caches of the same page size."""
        rows = meta.shared.key_rows
        if cache.page_size not in rows:
            rows[cache.page_size] = cache.key_rows(meta.kv_slots)
        return rows[cache.page_size]

    @staticmethod
    def _reads(meta: AttentionMetadata, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows to gather [2 * B * Lmax], the gather buffer): shared by every forward over
        the same keys of caches of the same page size and row shape."""
        key = (cache.page_size, cache.num_kv_heads, cache.head_dim, cache.data.dtype)
        if key not in meta.shared.reads:
            read = TorchPagedAttention._key_rows(meta, cache).flatten()  # [B * Lmax]
            # keys then values; index_select copies whole rows (much faster than x[rows] here)
            rows = torch.cat((read, read + cache.page_size))
            # one gather buffer for all layers (a fresh large tensor per layer costs page faults)
            buffer = cache.data.new_empty(*rows.shape, *cache.data.shape[-2:])
            meta.shared.reads[key] = rows, buffer
        return meta.shared.reads[key]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        if self.kernel is not None:
            return self.kernel(q, k, v, self.cache.layer_rows(layer))
        keys, values = self.keys(layer, k, v)  # [B, Hkv, Lmax, D]
        b, qmax, hq, d = self.meta.num_seqs, self.meta.max_q, q.shape[1], q.shape[2]
        hkv = hq // self.group
        q_pad = self.padded(q).view(b, qmax, hkv, self.group, d).permute(0, 2, 3, 1, 4)
        q_pad = q_pad.reshape(b, hkv, self.group * qmax, d)
        out = F.scaled_dot_product_attention(q_pad, keys, values, attn_mask=self.mask)
        out = out.view(b, hkv, self.group, qmax, d).permute(0, 3, 1, 2, 4)
        return self.unpadded(out.reshape(b, qmax, hq, d))

    def keys(
        self, layer: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """This forward's keys and values [T, Hkv, D] written to layer `layer`'s cache; every
        sequence's keys and values after them [B, Hkv, Lmax, D] (the torch path only: a
        model attending its own way, as MLA's expanded form does, reads them here)."""
        assert self.kernel is None
        store = self.cache.layer_rows(layer)  # [pages * 2 * page_size, Hkv, D]
        store[self.write_rows[0]] = cast(k, store.dtype)
        store[self.write_rows[1]] = cast(v, store.dtype)
        torch.index_select(store, 0, self.read_rows, out=self.kv)
        b, lmax = self.meta.num_seqs, self.meta.kv_slots.shape[1]
        kv = cast(self.kv, k.dtype).view(2, b, lmax, *store.shape[1:])
        keys, values = kv.transpose(2, 3).unbind(0)
        return keys, values

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ...] as [B * Qmax, ...]: each sequence's rows then zero rows."""
        if self.dense:
            return x
        out = x.new_zeros(self.meta.num_seqs * self.meta.max_q, *x.shape[1:])
        out[self.meta.q_index] = x
        return out

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, Qmax, ...] back to the forward's rows [T, ...]."""
        x = x.reshape(-1, *x.shape[2:])
        return x if self.dense else x[self.meta.q_index]


INVARIANT_BLOCK = 64  # keys a block of the batch-invariant attention
INVARIANT_MIN_ROWS = 4  # the CPU's batched product rounds 1 or 2 rows apart from more


class InvariantAttention(TorchPagedAttention):
    """Paged attention whose result for a query depends on nothing but that query and the
    keys it sees: not on the other sequences, the number of queries, the padding, how a
    prompt was chunked or where a tree put its nodes (`--batch-invariant`).

    Keys go in blocks of INVARIANT_BLOCK from key 0, every block one product of the same
    shape; the softmax's sums and the weighted values add up block by block in key order,
    so that blocks past a query's keys add exact zeros. Each product has at least
    INVARIANT_MIN_ROWS query rows (zero rows pad). A tree's query sees its keys compacted
    into position order (the prefix, then its path), as plain decoding lays them out.
    """

    native_max_q = 0  # its own blocked products for every forward

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        store = self.cache.layer_rows(layer)
        store[self.write_rows[0]] = cast(k, store.dtype)
        store[self.write_rows[1]] = cast(v, store.dtype)
        meta = self.meta
        b, qmax, lmax = meta.num_seqs, meta.max_q, meta.kv_slots.shape[1]
        hq, d = q.shape[1], q.shape[2]
        hkv, group = hq // self.group, self.group
        q_pad = q.new_zeros(b * qmax, hq, d)
        q_pad[meta.q_index] = q * d**-0.5
        q_pad = q_pad.view(b, qmax, hkv, group, d).permute(0, 2, 1, 3, 4)  # [B, Hkv, Q, G, D]
        if meta.mask is None:  # every query's keys are a prefix, in position order
            torch.index_select(store, 0, self.read_rows, out=self.kv)
            kv = cast(self.kv, q.dtype).view(2, b, lmax, hkv, d)
            keys, values = kv.permute(0, 1, 3, 2, 4).unbind(0)  # [B, Hkv, Lmax, D]
            queries = q_pad.transpose(2, 3).reshape(b, hkv, group * qmax, d)
            mask = self.mask.expand(b, 1, group * qmax, lmax)
            out = _blocked_attention(queries, keys, values, mask)  # [B, Hkv, G * Q, D]
            out = out.view(b, hkv, group, qmax, d).permute(0, 3, 1, 2, 4)
        else:
            keys, values, mask = self._compacted(store, q.dtype)  # [B, Hkv, Q, L, D]
            out = _blocked_attention(q_pad, keys, values, mask)  # [B, Hkv, Q, G, D]
            out = out.permute(0, 2, 1, 3, 4)
        return out.reshape(-1, hq, d)[meta.q_index]

    def _compacted(self, store: torch.Tensor, dtype: torch.dtype):
        """Each query's visible keys moved to the front in key order (a tree's: the prefix,
        then its path, parents first); keys and values [B, Hkv, Q, Lmax, D] and the mask
        [B, 1, Q, 1, Lmax]."""
        meta = self.meta
        visible = meta.visible()  # [B, Q, Lmax]
        order = torch.sort((~visible).to(torch.uint8), dim=-1, stable=True).indices
        slots = meta.kv_slots[:, None].expand_as(order).gather(2, order)  # [B, Q, Lmax]
        rows = self.cache.key_rows(slots)
        b, qmax, lmax = slots.shape
        count = visible.sum(-1, keepdim=True)  # [B, Q, 1]
        mask = torch.arange(lmax, device=slots.device) < count  # [B, Q, Lmax]
        ps = self.cache.page_size
        keys = cast(store[rows.flatten()], dtype).view(b, qmax, lmax, *store.shape[1:])
        values = cast(store[rows.flatten() + ps], dtype).view(keys.shape)
        keys, values = keys.permute(0, 3, 1, 2, 4), values.permute(0, 3, 1, 2, 4)
        return keys, values, mask[:, None, :, None]


def _blocked_attention(
    q: torch.Tensor,  # [..., M, D] scaled queries
    keys: torch.Tensor,  # [..., L, D]
    values: torch.Tensor,  # [..., L, D]
    mask: torch.Tensor,  # [..., M or 1, L] bool, broadcast against the scores
) -> torch.Tensor:
    """softmax(q k^T) v over the visible keys, in fixed-shape blocks (InvariantAttention)."""
    rows, length = q.shape[-2], keys.shape[-2]
    extra = max(0, INVARIANT_MIN_ROWS - rows)
    if extra:
        q = torch.cat([q, q.new_zeros(*q.shape[:-2], extra, q.shape[-1])], -2)
        mask = mask.expand(*mask.shape[:-2], rows, length)
        mask = torch.cat([mask, mask.new_zeros(*mask.shape[:-2], extra, length)], -2)
    blocks = range(0, length, INVARIANT_BLOCK)
    scores = []
    for start in blocks:
        key = _padded(keys[..., start : start + INVARIANT_BLOCK, :], INVARIANT_BLOCK)
        seen = _padded(mask[..., start : start + INVARIANT_BLOCK], INVARIANT_BLOCK)
        scores.append(torch.matmul(q, key.transpose(-1, -2)).masked_fill(~seen, float("-inf")))
    top = torch.stack([s.amax(-1) for s in scores]).amax(0)[..., None]  # exact
    top = top.masked_fill(top == float("-inf"), 0.0)  # rows that see nothing: padding
    total = out = None
    for start, s in zip(blocks, scores, strict=True):
        e = (s - top).exp()
        value = _padded(values[..., start : start + INVARIANT_BLOCK, :], INVARIANT_BLOCK)
        part, weighted = e.sum(-1, keepdim=True), torch.matmul(e, value)
        total = part if total is None else total + part
        out = weighted if out is None else out + weighted
    assert total is not None and out is not None
    return (out / total)[..., :rows, :]


def _padded(x: torch.Tensor, size: int) -> torch.Tensor:
    """x padded with zeros (False) along its keys (dim -2; a mask's: dim -1) to `size`."""
    dim = -1 if x.dtype == torch.bool else -2
    missing = size - x.shape[dim]
    if not missing:
        return x
    return F.pad(x, [0, missing] if dim == -1 else [0, 0, 0, missing])


def cast(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`; a tensor already in it costs no call (layers make several a forward)."""
    return x if x.dtype == dtype else x.to(dtype)


class CausalAttention:
    """Dense causal attention over a [batch, seq] block of tokens with no cache (training)."""

    def __init__(self, batch: int, seq: int):
        self.batch, self.seq = batch, seq

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, s = self.batch, self.seq
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        group = hq // hkv
        qb = q.view(b, s, hq, d).transpose(1, 2)
        kb = k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
        vb = v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True)
        return out.transpose(1, 2).reshape(b * s, hq, d)


def paged_metadata(
    qo_indptr: torch.Tensor,  # [B + 1]
    kv_indptr: torch.Tensor,  # [B + 1]
    kv_indices: torch.Tensor,  # [P]
    kv_last_page_len: torch.Tensor,  # [B]
    positions: torch.Tensor,  # [T]
    slot_mapping: torch.Tensor,  # [T]
    page_size: int,
    max_q: int,
    max_kv: int,
    mask: torch.Tensor | None = None,  # [B, max_q, max_kv] bool
) -> AttentionMetadata:
    """The torch backend's padded form of FlashInfer's CSR metadata, built on the device."""
    qo_indptr, kv_indptr = qo_indptr.long(), kv_indptr.long()
    b = kv_last_page_len.shape[0]
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    kv_lens = (num_pages - 1) * page_size + kv_last_page_len.long()
    j = torch.arange(max_kv, device=positions.device)
    last_page = max(len(kv_indices) - 1, 0)
    page_pos = (kv_indptr[:-1, None] + j[None, :] // page_size).clamp(max=last_page)
    kv_slots = kv_indices.long()[page_pos] * page_size + j[None, :] % page_size
    kv_slots = torch.where(j[None, :] < kv_lens[:, None], kv_slots, torch.zeros_like(kv_slots))
    t = torch.arange(positions.shape[0], device=positions.device)
    if positions.shape[0] == b * max_q:  # every sequence has max_q tokens: no padding
        q_index, q_positions = t, positions.long()
    else:
        seq = torch.searchsorted(qo_indptr[1:], t, right=True)
        q_index = seq * max_q + (t - qo_indptr[seq])
        q_positions = torch.zeros(b * max_q, dtype=torch.long, device=positions.device)
        q_positions[q_index] = positions.long()
    return AttentionMetadata(
        slot_mapping=slot_mapping.long(),
        kv_slots=kv_slots,
        kv_lens=kv_lens,
        q_index=q_index,
        q_positions=q_positions.view(b, max_q),
        mask=mask,
    )


def probe_attention(
    backend: AttentionBackend, cache: KVCache, num_q_heads: int, num_tokens: int
) -> Attention:
    """The attention of a forward the cost model times (a probe at start-up, the cache still
    empty): one sequence's first `num_tokens` tokens written over the cache's first pages, as
    the engine's decode steps attend (through the native kernel and decoder where they run,
    which CausalAttention takes neither of: SmolLM2's one-token forward costs 2.5x there, its
    second token half as much again). A prefill's size, or one past the cache, is causal."""
    page_size, num_pages = cache.page_size, cache.data.shape[1]
    if num_tokens > TorchPagedAttention.native_max_q or num_tokens > num_pages * page_size:
        return CausalAttention(num_tokens, 1)
    return backend(_probe_metadata(num_tokens, page_size, cache.data.device), cache, num_q_heads)


def _probe_metadata(num_tokens: int, page_size: int, device: torch.device) -> AttentionMetadata:
    pages = -(-num_tokens // page_size)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=device)

    every = ints(list(range(num_tokens)))
    last = num_tokens - (pages - 1) * page_size
    return paged_metadata(
        ints([0, num_tokens]),
        ints([0, pages]),
        ints(list(range(pages))),
        ints([last]),
        every,
        every,
        page_size,
        num_tokens,
        num_tokens,
    )
