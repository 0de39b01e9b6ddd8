"""Attention masks in the packed form FlashInfer reads.

FlashInfer's custom mask for request b is a [qo_len_b, kv_len_b] bool matrix, flattened row-major
and packed eight elements to a byte, little-endian bit order (element 8 * i + j is bit j of byte
i). Each request's bits start on a fresh byte, so `mask_indptr` counts bytes; this is what
`flashinfer.quantization.segment_packbits(..., bitorder="little")` produces. Packing here, on the
CPU at plan time, keeps the device and its synchronisations out of the plan.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def pack_tree_mask(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack per-request [qo_len, kv_len] bool masks.

    Returns the packed bytes [sum(ceil(qo_len * kv_len / 8))] uint8 and `mask_indptr` [B + 1]
    int32, the byte offset of each request's segment.
    """
    device = masks[0].device if masks else torch.device("cpu")
    segments, sizes = [], [0]
    for mask in masks:
        bits = mask.reshape(-1).to(torch.uint8)
        segments.append(F.pad(bits, (0, -bits.numel() % 8)))  # each request starts a byte
        sizes.append(segments[-1].numel() // 8)
    indptr = torch.tensor(sizes, dtype=torch.int32, device=device).cumsum(0, dtype=torch.int32)
    if not segments:
        return torch.zeros(0, dtype=torch.uint8, device=device), indptr
    bits = torch.cat(segments).view(-1, 8).to(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=device)
    packed = (bits << shifts).sum(dim=1).to(torch.uint8)  # [total bytes]
    return packed, indptr


def pack_padded_mask(visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`pack_tree_mask` of every row of visible [B, Q, L] bool, on its device, without reading
    it: the segments are all Q * L bits, so their offsets come from the shape alone (on the
    host, int32)."""
    rows, q, keys = visible.shape
    bits = F.pad(visible.reshape(rows, q * keys).to(torch.uint8), (0, -(q * keys) % 8))
    shifts = torch.arange(8, dtype=torch.uint8, device=visible.device)
    packed = (bits.view(rows, -1, 8) << shifts).sum(dim=2, dtype=torch.uint8).reshape(-1)
    indptr = torch.arange(rows + 1, dtype=torch.int32) * (bits.shape[1] // 8)
    return packed, indptr
