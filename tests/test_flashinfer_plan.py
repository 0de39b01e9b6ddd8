"""The engine's FlashInfer backend on the CPU, through a stand-in for FlashInfer's paged prefill
that reads what the plan hands it the way the kernel does (pages from indptr, indices and the
last page's length, a packed custom mask at byte offsets): every forward shape of the engine
(prefill, decode, verify, trees, padded queries) equals the torch backend, and the plan takes
its lengths from the host, never from the device."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from kv.cache import KVCache
from models.attention import TorchPagedAttention
from models.flashinfer_backend import FlashInferBackend
from models.graphs import GraphedForward
from models.masks import pack_padded_mask, pack_tree_mask
from tests.attention_cases import CASES, NUM_PAGES, Batch, Seq


class PagedPrefill:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper, as the engine calls it, in torch; with
    `use_cuda_graph`, over the fixed buffers it is given, which plan() fills and run() reads."""

    def __init__(self, workspace, layout, backend, use_cuda_graph=False, **buffers):
        assert layout == "NHD" and backend == "fa2"
        self.graph = use_cuda_graph
        for name, buffer in buffers.items():  # FlashInfer's own attribute names
            setattr(self, f"_{name}", buffer)
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads,
             head_dim, page_size, packed_custom_mask, causal, **kw):  # fmt: skip
        for host in (qo_indptr, kv_indptr, last_page_len):  # what FlashInfer plans on the host
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert packed_custom_mask is not None and not causal
        self.plans += 1
        self.page_size = page_size
        self._qo_indptr_last = int(qo_indptr[-1])
        inputs = {
            "qo_indptr_buf": qo_indptr,
            "paged_kv_indptr_buf": kv_indptr,
            "paged_kv_indices_buf": kv_indices,
            "paged_kv_last_page_len_buf": last_page_len,
            "custom_mask_buf": packed_custom_mask,
        }
        for name, value in inputs.items():
            if self.graph:  # the sizes were fixed when the wrapper was made
                getattr(self, f"_{name}").copy_(value)
            else:
                setattr(self, f"_{name}", value)
        if not self.graph:
            self._mask_indptr_buf = None  # the planner sets the byte offsets (flashinfer#2201)

    def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # kv [P, 2, ps, H, D]
        out = torch.empty_like(q)
        bits = self._custom_mask_buf[:, None].bitwise_right_shift(torch.arange(8)) & 1
        bits = bits.reshape(-1).bool()
        qo_indptr, kv_indptr = self._qo_indptr_buf, self._paged_kv_indptr_buf
        for b in range(len(qo_indptr) - 1):
            pages = self._paged_kv_indices_buf[kv_indptr[b] : kv_indptr[b + 1]].long()
            kv_len = (len(pages) - 1) * self.page_size + int(self._paged_kv_last_page_len_buf[b])
            keys, values = (kv[pages, i].flatten(0, 1)[:kv_len] for i in (0, 1))
            q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
            start = int(self._mask_indptr_buf[b]) * 8
            mask = bits[start : start + (q1 - q0) * kv_len].view(q1 - q0, kv_len)
            group = q.shape[1] // keys.shape[1]
            k, v = (x.repeat_interleave(group, dim=1).transpose(0, 1) for x in (keys, values))
            scores = q[q0:q1].transpose(0, 1) @ k.transpose(1, 2) / q.shape[-1] ** 0.5
            weights = scores.masked_fill(~mask, float("-inf")).softmax(-1)
            out[q0:q1] = (weights @ v).transpose(0, 1)
        return out


class Event:
    def query(self) -> bool:
        return True

    def record(self) -> None:
        pass


@pytest.fixture
def fake_flashinfer(monkeypatch):
    module = types.ModuleType("flashinfer")
    module.BatchPrefillWithPagedKVCacheWrapper = PagedPrefill
    monkeypatch.setitem(sys.modules, "flashinfer", module)
    monkeypatch.setattr(torch.cuda, "Event", Event)


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_the_backend_equals_the_torch_backend(fake_flashinfer, case, page_size):
    heads, kv_heads, head_dim = 4, 2, 8
    batch = Batch(CASES[case], page_size, seed=page_size)
    caches = [KVCache(2, NUM_PAGES, page_size, kv_heads, head_dim) for _ in range(2)]
    caches[0].data.normal_()
    caches[1].data.copy_(caches[0].data)
    meta = batch.metadata()
    ours, theirs = TorchPagedAttention(meta, caches[0], heads), FlashInferBackend()
    attend = theirs(meta, caches[1], heads)
    for layer in range(2):
        q = torch.randn(batch.num_tokens, heads, head_dim)
        k, v = torch.randn(2, batch.num_tokens, kv_heads, head_dim)
        torch.testing.assert_close(attend(layer, q, k, v), ours(layer, q, k, v))
    assert torch.equal(caches[0].data, caches[1].data)


def test_a_padded_mask_packs_as_its_rows_do():
    visible = torch.rand(5, 3, 19) < 0.5
    packed, indptr = pack_padded_mask(visible)
    want, want_indptr = pack_tree_mask(list(visible))
    assert torch.equal(packed, want) and torch.equal(indptr, want_indptr)
    assert indptr.device.type == "cpu"


STEPS = {  # two steps of one bucket each: 4 sequences, the same queries each, 256 keys
    "chain": ([Seq(20, 2), Seq(35, 2), Seq(9, 2)], [Seq(50, 2), Seq(12, 2), Seq(3, 2), Seq(8, 2)]),
    "tree": (
        [Seq(7, 3, [-1, 0, 0]), Seq(18, 3, [-1, 0, 1]), Seq(2, 3, [-1, -1, 0])],
        [
            Seq(40, 3, [-1, -1, 0]),
            Seq(3, 3, [-1, 0, 0]),
            Seq(9, 3, [-1, 0, 1]),
            Seq(1, 3, [-1, 0, 1]),
        ],
    ),
}


@pytest.mark.parametrize("case", sorted(STEPS))
def test_static_forwards_plan_once_a_bucket_and_equal_the_torch_backend(fake_flashinfer, case):
    """Forwards over a bucket's static buffers (models/graphs.py, as captured): the bucket's
    wrapper is made with FlashInfer's CUDA-graph buffers and planned once; the next step of
    the bucket writes its pages and mask into those buffers on the device, and both steps
    attend as the torch backend does."""
    heads, kv_heads, head_dim, page_size = 4, 2, 8, 4
    caches = [KVCache(1, NUM_PAGES + 1, page_size, kv_heads, head_dim) for _ in range(2)]
    caches[0].data.normal_()
    caches[1].data.copy_(caches[0].data)
    backend = FlashInferBackend()

    def forward(ids, positions, meta, q, k, v):
        return (backend(meta, caches[1], heads)(0, q, k, v),)

    scratch = NUM_PAGES * page_size
    graphed = GraphedForward(forward, torch.device("cpu"), scratch, capture=False)
    for seed, seqs in enumerate(STEPS[case]):
        batch = Batch(seqs, page_size, seed=seed)
        meta = batch.metadata()
        q = torch.randn(batch.num_tokens, heads, head_dim)
        k, v = torch.randn(2, batch.num_tokens, kv_heads, head_dim)
        want = TorchPagedAttention(meta, caches[0], heads)(0, q, k, v)
        ids = torch.zeros(batch.num_tokens, dtype=torch.long)
        (got,) = graphed(ids, meta.q_positions.flatten(), meta, q, k, v)
        torch.testing.assert_close(got, want)
    (wrappers,) = backend.by_shape.values()
    (wrapper,) = wrappers.buckets.values()
    assert wrapper.graph and wrapper.plans == 1  # planned at the first step alone
    assert wrappers.planned == -1  # and the ring of eager plans never used
    torch.testing.assert_close(caches[1].data[:, :NUM_PAGES], caches[0].data[:, :NUM_PAGES])
