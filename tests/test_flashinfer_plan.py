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
from models.masks import pack_padded_mask, pack_tree_mask
from tests.attention_cases import CASES, NUM_PAGES, Batch


class PagedPrefill:
    """FlashInfer's BatchPrefillWithPagedKVCacheWrapper, as the engine calls it, in torch."""

    def __init__(self, workspace, layout, backend):
        assert layout == "NHD" and backend == "fa2"

    def plan(self, qo_indptr, kv_indptr, kv_indices, last_page_len, num_q_heads, num_kv_heads,
             head_dim, page_size, packed_custom_mask, causal, **kw):  # fmt: skip
        for host in (qo_indptr, kv_indptr, last_page_len):  # what FlashInfer plans on the host
            assert host.device.type == "cpu" and host.dtype == torch.int32
        assert packed_custom_mask is not None and not causal
        self.qo_indptr, self.kv_indptr, self.kv_indices = qo_indptr, kv_indptr, kv_indices
        self.last_page_len, self.page_size = last_page_len, page_size
        self._custom_mask_buf = packed_custom_mask
        self._mask_indptr_buf = None  # the planner sets the byte offsets (flashinfer#2201)
        self._qo_indptr_last = int(qo_indptr[-1])

    def run(self, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:  # kv [P, 2, ps, H, D]
        out = torch.empty_like(q)
        bits = self._custom_mask_buf[:, None].bitwise_right_shift(torch.arange(8)) & 1
        bits = bits.reshape(-1).bool()
        for b in range(len(self.qo_indptr) - 1):
            pages = self.kv_indices[self.kv_indptr[b] : self.kv_indptr[b + 1]].long()
            kv_len = (len(pages) - 1) * self.page_size + int(self.last_page_len[b])
            keys, values = (kv[pages, i].flatten(0, 1)[:kv_len] for i in (0, 1))
            q0, q1 = int(self.qo_indptr[b]), int(self.qo_indptr[b + 1])
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
