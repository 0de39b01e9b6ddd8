"""Time FlashInfer's JIT compile of the kernels the engine runs (bfloat16, head size 64, FA2
with a custom mask), so that the steps after it find them built.

    python tests/gpu/compile_flashinfer.py
"""

from __future__ import annotations

import time

import torch

from kv.cache import KVCache
from models.flashinfer_backend import FlashInferWrappers
from models.masks import pack_tree_mask


def main() -> None:
    heads, kv_heads, head_dim, page_size = 4, 2, 64, 16
    cache = KVCache(1, 4, page_size, kv_heads, head_dim, torch.bfloat16, "cuda")
    cache.data.normal_()
    int32 = {"dtype": torch.int32}
    csr = (torch.tensor([0, 3], **int32), torch.tensor([0, 2], **int32),
           torch.tensor([0, 1], **int32), torch.tensor([4], **int32))  # fmt: skip
    q = torch.randn(3, heads, head_dim, dtype=torch.bfloat16, device="cuda")
    k = torch.randn(3, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda")
    slots = torch.tensor([17, 18, 19], device="cuda")
    for name, mask in [("custom mask", pack_tree_mask([torch.ones(3, 20).tril(17) > 0])),
                       ("causal", None)]:  # fmt: skip
        start = time.perf_counter()
        wrappers = FlashInferWrappers(heads, kv_heads, head_dim, page_size, torch.bfloat16)
        wrappers.plan(*csr, tree_mask=mask)
        wrappers.bind(cache, slots)(0, q, k, k)
        torch.cuda.synchronize()
        print(f"FlashInfer prefill, {name}: first plan and run {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
