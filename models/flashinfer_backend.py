"""FlashInfer attention over the paged KV cache (CUDA only).

Prefill, decode and chain verify are one kind of call for FlashInfer: a batch of ragged query
runs appended to paged keys, `causal=True`. FlashInfer aligns a request's qo_len queries with
its last qo_len keys, which is our rule (query i sits at position kv_len - qo_len + i and sees
keys up to it). A tree replaces the causal rule with a packed custom mask (`models.masks`).

`flashinfer` is imported when a planner is built, never when this module is imported: the CPU
environment does not install it. `FlashInferBackend` is the engine's entry (the attention
backend protocol); it is not the default until tests/gpu/ proves it through the engine.
"""

from __future__ import annotations

import torch

from core.attention import AttentionMetadata
from kv.cache import KVCache
from models.masks import pack_tree_mask

FLASHINFER_HEAD_DIMS = (64, 128, 256)  # the head sizes its prefill kernels are built for
WORKSPACE_BYTES = 128 * 1024 * 1024  # FlashInfer's recommended float workspace per wrapper


class FlashInferPlanner:
    """Plans FlashInfer attention for one model (one head shape and dtype), once per step.

    `plan()` runs at plan time on the host: it takes the step's CSR page table as int32 CPU
    tensors, schedules the work and queues the copies to the device on the current stream.
    `bind(cache, slot_mapping)` gives the backend that every layer of that step's forward calls.
    Two wrappers alternate, so planning step N+1 never touches the buffers that step N's kernels
    may still be reading; step N-1 must have completed by then.
    """

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
        self.wrappers = [
            flashinfer.BatchPrefillWithPagedKVCacheWrapper(
                torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device),
                "NHD",
                backend="fa2",  # the engine's custom masks run on FA2 (FA3 takes none)
            )
            for _ in range(2)
        ]
        self.planned = -1  # index of the wrapper holding the latest plan

    def plan(
        self,
        qo_indptr: torch.Tensor,  # [B + 1] int32
        kv_indptr: torch.Tensor,  # [B + 1] int32
        kv_indices: torch.Tensor,  # [P] int32
        kv_last_page_len: torch.Tensor,  # [B] int32, 1..page_size
        tree_mask: tuple[torch.Tensor, torch.Tensor] | None = None,  # pack_tree_mask(...)
    ) -> None:
        self.planned = (self.planned + 1) % 2
        wrapper = self.wrappers[self.planned]
        packed = None if tree_mask is None else tree_mask[0]
        wrapper.plan(
            qo_indptr,
            kv_indptr,
            kv_indices,
            kv_last_page_len,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_dim,
            self.page_size,
            packed_custom_mask=packed,
            causal=tree_mask is None,
            q_data_type=self.dtype,
            kv_data_type=self.dtype,
            non_blocking=True,
        )
        if tree_mask is not None:
            # Given a packed mask, FlashInfer keeps the per-request offsets it computed in bits,
            # while its kernel reads them as bytes (flashinfer-ai/flashinfer#2201); hand it the
            # byte offsets of our per-request segments.
            wrapper._mask_indptr_buf = tree_mask[1].to(self.device, non_blocking=True)

    def bind(self, cache: KVCache, slot_mapping: torch.Tensor) -> FlashInferAttention:
        """The backend of the latest plan over `cache`; slot_mapping [T] on the device."""
        if self.planned < 0:
            raise RuntimeError("plan() must run before bind()")
        return FlashInferAttention(self.wrappers[self.planned], cache, slot_mapping)


class FlashInferAttention:
    """Same contract as TorchPagedAttention: writes the new K/V, then attends over the pages."""

    def __init__(self, wrapper, cache: KVCache, slot_mapping: torch.Tensor):
        self.wrapper = wrapper
        self.cache = cache
        self.write_rows = cache.key_rows(slot_mapping.long())  # [T]

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        # our cache is FlashInfer's single-tensor NHD layout, so writing through the slot rows is
        # the same as flashinfer.page.append_paged_kv_cache, without its batch-index metadata
        store = self.cache.layer_rows(layer)  # [pages * 2 * page_size, Hkv, D]
        store[self.write_rows] = k.to(store.dtype)
        store[self.write_rows + self.cache.page_size] = v.to(store.dtype)
        # q is a view into the rotated q|k rows (models/llama.py); the kernel reads dense rows
        return self.wrapper.run(q.contiguous(), self.cache.data[layer])  # [T, Hq, D]


class FlashInferBackend:
    """The AttentionBackend protocol over FlashInfer (`--attention flashinfer`, CUDA only).

    Each forward is planned from its own metadata: the pages from `kv_slots` and `kv_lens`,
    and what each query sees as a custom mask (`meta.visible()`), which holds for every
    forward the engine runs, including drafter forwards whose queries sit before the step's
    last keys (FlashInfer's causal alignment would not). Planning reads the metadata on the
    host: a device sync per forward, which planning at plan time (from the step's CSR,
    `FlashInferPlanner.plan`) would remove.
    """

    def __init__(self) -> None:
        self.planners: dict[tuple, FlashInferPlanner] = {}  # one per head shape and dtype

    def __call__(
        self, meta: AttentionMetadata, cache: KVCache, num_q_heads: int
    ) -> FlashInferAttention:
        dtype, device, ps = cache.data.dtype, cache.data.device, cache.page_size
        key = (num_q_heads, cache.num_kv_heads, cache.head_dim, ps, dtype, device)
        planner = self.planners.get(key)
        if planner is None:
            planner = FlashInferPlanner(
                num_q_heads, cache.num_kv_heads, cache.head_dim, ps, dtype, device
            )
            self.planners[key] = planner
        kv_lens = meta.kv_lens.cpu()
        q_lens = torch.bincount(meta.q_index.cpu() // meta.max_q, minlength=kv_lens.numel())
        num_pages = (kv_lens + ps - 1) // ps
        first_slots = meta.kv_slots[:, ::ps].cpu()  # [B, pages] each page's first slot
        pages = [first_slots[b, :n] // ps for b, n in enumerate(num_pages.tolist())]
        visible = meta.visible()  # [B, Qmax, Lmax]
        lens = zip(q_lens.tolist(), kv_lens.tolist(), strict=True)
        masks = [visible[b, :q, :n].cpu() for b, (q, n) in enumerate(lens)]
        int32 = torch.int32
        zero = torch.zeros(1, dtype=int32)
        planner.plan(
            torch.cat([zero, q_lens.cumsum(0).to(int32)]),
            torch.cat([zero, num_pages.cumsum(0).to(int32)]),
            torch.cat(pages).to(int32),
            (kv_lens - (num_pages - 1) * ps).to(int32),
            pack_tree_mask(masks),
        )
        return planner.bind(cache, meta.slot_mapping)
