"""FlashInfer backend against the torch backend on CUDA, and its packed-mask layout.

Run on an accelerator with tests/gpu/check.sh; skipped on a CPU (and without flashinfer).
"""

from __future__ import annotations

import random

import pytest
import torch

from kv.cache import KVCache
from models.attention import TorchPagedAttention
from models.masks import pack_tree_mask
from tests.attention_cases import CASES, NUM_PAGES, Batch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer runs on CUDA only"),
]
flashinfer = pytest.importorskip("flashinfer")

# FlashInfer runs 16-bit types and head_dim 64+; bfloat16, the engine's, compiles one module
LAYERS, HEAD_DIM, DTYPE = 2, 64, torch.bfloat16


def planned(batch: Batch, num_q_heads: int, num_kv_heads: int, wrappers=None):
    """(torch backend, FlashInfer backend) over two caches holding the same noise."""
    from models.flashinfer_backend import FlashInferWrappers

    caches = [
        KVCache(LAYERS, NUM_PAGES, batch.page_size, num_kv_heads, HEAD_DIM, DTYPE, "cuda")
        for _ in range(2)
    ]
    caches[0].data.normal_()
    caches[1].data.copy_(caches[0].data)
    if wrappers is None:
        wrappers = FlashInferWrappers(num_q_heads, num_kv_heads, HEAD_DIM, batch.page_size, DTYPE)
    tree = pack_tree_mask([s.mask() for s in batch.seqs]) if batch.trees else None
    wrappers.plan(*batch.csr_tensors(), tree_mask=tree)
    theirs = wrappers.bind(caches[1], torch.tensor(batch.slots, device="cuda"))
    ours = TorchPagedAttention(batch.metadata("cuda"), caches[0], num_q_heads)
    return ours, theirs


def compare(batch: Batch, ours, theirs, num_q_heads: int, num_kv_heads: int) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for layer in range(LAYERS):
        q = torch.randn(batch.num_tokens, num_q_heads, HEAD_DIM, generator=gen, device="cuda")
        kv_shape = (batch.num_tokens, num_kv_heads, HEAD_DIM)
        k = torch.randn(kv_shape, generator=gen, device="cuda")
        v = torch.randn(kv_shape, generator=gen, device="cuda")
        q, k, v = q.to(DTYPE), k.to(DTYPE), v.to(DTYPE)
        want, got = ours(layer, q, k, v), theirs(layer, q, k, v)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    assert torch.equal(ours.cache.data, theirs.cache.data)


@pytest.mark.parametrize("heads", [(4, 2), (8, 1)])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", sorted(CASES))
def test_flashinfer_matches_torch_backend(case, page_size, heads):
    batch = Batch(CASES[case], page_size, seed=page_size)
    compare(batch, *planned(batch, *heads), *heads)


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_engine_backend_matches_torch_backend(case):
    """FlashInferBackend (what `--attention flashinfer` runs) planned from a forward's metadata,
    custom mask and all, against the torch backend on the same metadata."""
    from models.flashinfer_backend import FlashInferBackend

    batch, heads = Batch(CASES[case], 16, seed=3), (4, 2)
    caches = [KVCache(LAYERS, NUM_PAGES, 16, heads[1], HEAD_DIM, DTYPE, "cuda") for _ in range(2)]
    caches[0].data.normal_()
    caches[1].data.copy_(caches[0].data)
    meta = batch.metadata("cuda")
    ours = TorchPagedAttention(meta, caches[0], heads[0])
    compare(batch, ours, FlashInferBackend()(meta, caches[1], heads[0]), *heads)


def test_plan_ahead_keeps_the_bound_plan():
    """Planning step N+1 before step N's forward runs leaves step N's plan intact."""
    from models.flashinfer_backend import FlashInferWrappers

    wrappers = FlashInferWrappers(4, 2, HEAD_DIM, 16, DTYPE)
    now, ahead = Batch(CASES["tree"], 16, seed=1), Batch(CASES["verify"], 16, seed=2)
    backends_now = planned(now, 4, 2, wrappers)
    backends_ahead = planned(ahead, 4, 2, wrappers)
    compare(now, *backends_now, 4, 2)
    compare(ahead, *backends_ahead, 4, 2)


def test_pack_tree_mask_equals_segment_packbits():
    rng = random.Random(0)
    masks = [torch.rand(rng.randint(1, 9), rng.randint(1, 70)) < 0.5 for _ in range(6)]
    packed, indptr = pack_tree_mask(masks)
    bit_indptr = torch.tensor([0] + [m.numel() for m in masks]).cumsum(0).cuda()
    flat = torch.cat([m.flatten() for m in masks]).cuda()
    want, want_indptr = flashinfer.quantization.segment_packbits(flat, bit_indptr, "little")
    assert torch.equal(packed.cuda(), want)
    assert indptr.tolist() == want_indptr.tolist()
