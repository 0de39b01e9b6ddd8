"""Per-model KV storage, indexed by the page ids of the engine's one PageAllocator."""

from __future__ import annotations

import torch


class KVCache:
    """Keys and values of every layer: [layers, pages, 2, page_size, kv_heads, head_dim].

    This is FlashInfer's NHD layout. Slot s is offset s % page_size of page s // page_size; its
    key is row `(s // page_size) * 2 * page_size + s % page_size` of a layer's flat view, and
    its value sits `page_size` rows further.
    """

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        queries: torch.dtype | None = None,
    ):
        """`queries`: the dtype of the queries that attend over it (None: `dtype`)."""
        self.queries = queries or dtype
        self.page_size = page_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.data = torch.zeros(
            num_layers, num_pages, 2, page_size, num_kv_heads, head_dim, dtype=dtype, device=device
        )
        # each layer's rows, made once: attention reads them every layer of every forward
        self._layer_rows = [layer.view(-1, num_kv_heads, head_dim) for layer in self.data]

    @property
    def num_pages(self) -> int:
        return self.data.shape[1]

    def layer_rows(self, layer: int) -> torch.Tensor:
        """[pages * 2 * page_size, kv_heads, head_dim] view of one layer."""
        return self._layer_rows[layer]

    def key_rows(self, slots: torch.Tensor) -> torch.Tensor:
        """Row of each slot's key in `layer_rows` (same shape as `slots`)."""
        # page p's keys take rows 2p * ps .. (2p + 1) * ps: slot p * ps + i is row slot + p * ps
        ps = self.page_size
        return slots + torch.div(slots, ps, rounding_mode="floor") * ps

    def move(self, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
        """Copy K and V of every layer from src to dst slots ([N] each); used after a tree."""
        src, dst = self.key_rows(src_slots), self.key_rows(dst_slots)
        ps = self.page_size
        rows = self.data.view(self.data.shape[0], -1, self.num_kv_heads, self.head_dim)
        # one gather then one scatter over all layers (the gather copies, so a source that is
        # also a destination is read before it is written)
        rows[:, torch.cat((dst, dst + ps))] = rows[:, torch.cat((src, src + ps))]

    @staticmethod
    def bytes_per_page(
        num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * page_size * num_kv_heads * head_dim * itemsize
