"""FlashInfer attention over the paged KV cache (CUDA only).

Prefill, decode and chain verify are one kind of call for FlashInfer: a batch of ragged query
runs appended to paged keys, `causal=True`. FlashInfer aligns a request's qo_len queries with
its last qo_len keys, which is our rule (query i sits at position kv_len - qo_len + i and sees
keys up to it). A tree replaces the causal rule with a packed custom mask (`models.masks`).

The engine's forwards (`FlashInferBackend`) are planned without reading the device: what a
step's forwards see is settled on the device (the host plans step N+1 before it knows what step
N accepted), so each forward is planned over its metadata's padded shape, known on the host,
and the device builds the mask that says which of those keys and queries are real.

`flashinfer` is imported when a model's wrappers are built, never when this module is
imported: the CPU environment does not install it.
"""

from __future__ import annotations

from typing import Any

import torch

from core.attention_metadata import AttentionMetadata
from kv.cache import KVCache
from models.graphs import over_static_buffers
from models.masks import pack_padded_mask

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes its prefill kernels are built for
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace per wrapper


class FlashInferWrappers:
    """FlashInfer's attention wrappers for one model (one head shape and dtype), planned once
    per forward.

    `plan()` runs on the host: it takes the forward's CSR page table as int32 CPU tensors (the
    page indices may be on the device), schedules the work and queues the copies to the device
    on the current stream. `bind(cache, slot_mapping)` gives the backend that every layer of
    that forward calls. Plans rotate over `RING` wrappers, so that planning a forward never
    rewrites the host buffer a queued copy of an earlier plan has yet to read; a wrapper is
    reused once the copies of its last plan have run (a wait only when the host is RING
    forwards ahead of the device). Forwards run on one stream, so they share one workspace.
    """

    RING = 8

    def __init__(
        self,
        num_q_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cuda",
    ):
        import flashinfer

        self.num_q_heads, self.num_kv_heads = num_q_heads, num_kv_heads
        self.head_dim, self.page_size, self.dtype = head_dim, page_size, dtype
        self.device = torch.device(device)
        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.wrappers = [
            # the engine's custom masks run on FA2 (FA3 takes none)
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa2")
            for _ in range(self.RING)
        ]
        self.copied: list[torch.cuda.Event | None] = [None] * self.RING
        self.planned = -1  # index of the wrapper holding the latest plan
        self.workspace = workspace
        self.buckets: dict[tuple[int, ...], Any] = {}  # static forwards' wrappers (`static`)

    def plan(
        self,
        qo_indptr: torch.Tensor,  # [B + 1] int32
        kv_indptr: torch.Tensor,  # [B + 1] int32
        kv_indices: torch.Tensor,  # [P] int32
        kv_last_page_len: torch.Tensor,  # [B] int32, 1..page_size
        tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None,  # pack_tree_mask(...)
    ) -> None:
        self.planned = (self.planned + 1) % self.RING
        wrapper, copied = self.wrappers[self.planned], self.copied[self.planned]
        if copied is not None and not copied.query():
            copied.synchronize()
        packed = None if tree_mask is None else tree_mask[0]
        self._plan(wrapper, (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), packed, True)
        if tree_mask is not None:
            # Given a packed mask, FlashInfer keeps the per-request offsets it computed in bits,
            # while its kernel reads them as bytes (flashinfer-ai/flashinfer#2201); hand it the
            # byte offsets of our per-request segments.
            wrapper._mask_indptr_buf = tree_mask[1].to(self.device, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        self.copied[self.planned] = copied

    def static(
        self,
        qo_indptr: torch.Tensor,  # as plan's
        kv_indptr: torch.Tensor,
        kv_indices: torch.Tensor,
        kv_last_page_len: torch.Tensor,
        tree_mask: tuple[torch.Tensor, torch.Tensor],
    ) -> Any:
        """The wrapper of a bucket's forwards over static buffers (models/graphs.py), made
        with FlashInfer's CUDA-graph buffers. Its plan depends on the bucket's shape alone
        (the host's arguments: every row the same queries over the same number of keys), so
        it is planned once, at the bucket's first forward (a graph's warm-up, never inside a
        capture); each later forward writes its page indices and mask into the buffers on
        the device, which a capture holds."""
        key = tuple(qo_indptr.tolist() + kv_indptr.tolist() + kv_last_page_len.tolist())
        packed, offsets = tree_mask
        wrapper = self.buckets.get(key)
        if wrapper is not None:
            wrapper._paged_kv_indices_buf.copy_(kv_indices)
            wrapper._custom_mask_buf.copy_(packed)
            return wrapper
        import flashinfer

        def buffer(n: int, dtype: torch.dtype = torch.int32) -> torch.Tensor:
            return torch.empty(n, dtype=dtype, device=self.device)

        rows = kv_last_page_len.shape[0]
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            self.workspace,
            "NHD",
            use_cuda_graph=True,
            qo_indptr_buf=buffer(rows + 1),
            paged_kv_indptr_buf=buffer(rows + 1),
            paged_kv_indices_buf=buffer(kv_indices.shape[0]),
            paged_kv_last_page_len_buf=buffer(rows),
            custom_mask_buf=buffer(packed.shape[0], torch.uint8),
            mask_indptr_buf=buffer(rows + 1),
            backend="fa2",
        )
        self._plan(wrapper, (qo_indptr, kv_indptr, kv_indices, kv_last_page_len), packed, False)
        wrapper._mask_indptr_buf.copy_(offsets)  # bytes, not bits: as in plan (#2201)
        self.buckets[key] = wrapper
        return wrapper

    def _plan(
        self,
        wrapper: Any,
        csr: tuple[torch.Tensor, ...],  # (qo_indptr, kv_indptr, kv_indices, kv_last_page_len)
        packed: torch.Tensor | None,  # a packed custom mask; None: causal
        non_blocking: bool,
    ) -> None:
        wrapper.plan(
            *csr,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            packed_custom_mask=packed,
            causal=packed is None,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=non_blocking,
        )

    def bind(
        self, cache: KVCache, slot_mapping: torch.Tensor, q_index: torch.Tensor | None = None
    ) -> FlashInferAttention:
        """The backend of the latest plan over `cache`; slot_mapping [T] on the device;
        q_index [T]: each token's query in a plan of padded query runs (None: unpadded)."""
        if self.planned < 0:
            raise RuntimeError("plan() must run before bind()")
        return FlashInferAttention(self.wrappers[self.planned], cache, slot_mapping, q_index)


class FlashInferAttention:
    """Same contract as TorchPagedAttention: writes the new K/V, then attends over the pages."""

    def __init__(
        self, wrapper, cache: KVCache, slot_mapping: torch.Tensor, q_index: torch.Tensor | None
    ):
        self.wrapper = wrapper
        self.cache = cache
        self.write_rows = cache.key_rows(slot_mapping.long())  # [T]
        self.q_index = q_index
        self.padded = wrapper._qo_indptr_last  # queries in the plan

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # our cache is FlashInfer's single-tensor NHD layout, so writing through the slot rows is
        # the same as flashinfer.page.append_paged_kv_cache, without its batch-index metadata
        store = self.cache.layer_rows(layer)  # [pages * 2 * page_size, Hkv, D]
        store[self.write_rows] = k.to(store.dtype)
        store[self.write_rows + self.cache.page_size] = v.to(store.dtype)
        if self.q_index is None:
            # q is a view into the rotated q|k rows (models/llama.py); the kernel reads dense rows
            return self.wrapper.run(q.contiguous(), self.cache.data[layer])  # [T, Hq, D]
        runs = q.new_zeros(self.padded, *q.shape[1:])  # padding queries: zeros, dropped after
        runs[self.q_index] = q
        return self.wrapper.run(runs, self.cache.data[layer])[self.q_index]


class FlashInferBackend:
    """The AttentionBackend protocol over FlashInfer (`--attention flashinfer`, CUDA only).

    A forward is planned over its metadata's padded shape, every sequence `max_q` queries over
    `Lmax` keys (the torch backend's layout), which the host knows without reading the device:
    each row's pages are the first slots of its key pages (slot 0's page past its keys), and
    what each query sees is a custom mask packed on the device (`meta.visible()`), which holds
    for every forward the engine runs, drafter forwards whose queries sit before the step's
    last keys included (FlashInfer's causal alignment would not). Keys past a row's own are
    read and masked: the cache starts zeroed, so they are finite.
    """

    def __init__(self) -> None:
        self.by_shape: dict[tuple, FlashInferWrappers] = {}  # one per head shape and dtype

    def __call__(
        self, meta: AttentionMetadata, cache: KVCache, num_q_heads: int
    ) -> FlashInferAttention:
        dtype, device, ps = cache.data.dtype, cache.data.device, cache.page_size
        key = (num_q_heads, cache.num_kv_heads, cache.head_dim, ps, dtype, device)
        wrappers = self.by_shape.get(key)
        if wrappers is None:
            wrappers = FlashInferWrappers(
                num_q_heads, cache.num_kv_heads, cache.head_dim, ps, dtype, device
            )
            self.by_shape[key] = wrappers
        rows, max_q, max_kv = meta.num_seqs, meta.max_q, meta.kv_slots.shape[1]
        pages = -(-max_kv // ps)  # each row's, the last holding max_kv - (pages - 1) * ps keys
        indices = (meta.kv_slots[:, ::ps] // ps).to(torch.int32).reshape(-1)  # [B * pages]
        mask = pack_padded_mask(meta.visible())
        padded = meta.q_index.numel() != rows * max_q
        q_index = meta.q_index if padded else None
        every = torch.arange(rows + 1, dtype=torch.int32)
        last_page_len = torch.full((rows,), max_kv - (pages - 1) * ps, dtype=torch.int32)
        plan = (every * max_q, every * pages, indices, last_page_len, mask)
        if over_static_buffers():
            return FlashInferAttention(wrappers.static(*plan), cache, meta.slot_mapping, q_index)
        wrappers.plan(*plan)
        return wrappers.bind(cache, meta.slot_mapping, q_index)
