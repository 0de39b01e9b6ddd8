"""Forwards over static buffers, replayed as CUDA graphs (`--cuda-graphs`).

A decode step's forward has the same shapes step after step but for the number of sequences
and the keys each attends to. Both are bucketed here (sequences up to a bucket of
BATCH_BUCKETS, keys up to a power of two from MIN_KEYS); each bucket, with its rows per sequence
and whether a tree mask replaces the causal rule, has buffers of its own, into which a step
copies its inputs and metadata. Rows past the step's sequences write their keys and values to
a scratch slot no page holds and see that one key; keys past a sequence's own are masked by
its key count.

On CUDA a bucket's forward is captured as a graph the first time it runs (after a warm-up on
a side stream) and replayed after, every graph drawing from one memory pool: a small forward
is then one launch instead of hundreds. On the CPU the same buffers run eagerly, so the tests
hold the path that is captured to plain decoding. The forward must not read the device from
the host (no `.item()`, no shape that depends on values): what the attention derives from the
metadata is derived again at each replay (a fresh `SharedKeys` a call).
"""

from __future__ import annotations

import bisect
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from core.attention_metadata import AttentionMetadata, SharedKeys

BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # sequences a bucket holds (vLLM's are alike)
MIN_KEYS = 256  # the smallest key bucket; each next one doubles (attention past a
# sequence's keys is masked work, at most as much again as its own)

# (input ids [T], positions [T], metadata, more inputs [T, ...]) -> outputs [T, ...]
Forward = Callable[..., tuple[torch.Tensor, ...]]

_static = threading.local()  # which static run this thread is inside, if any


@contextlib.contextmanager
def _inside(kind: str) -> Iterator[None]:
    outer = getattr(_static, "kind", None)
    _static.kind = outer or kind
    try:
        yield
    finally:
        _static.kind = outer


def whole_step() -> contextlib.AbstractContextManager[None]:
    """While a whole step runs over static buffers as one graph (engine/step_graph.py): the
    forwards inside it run as they are (their inputs are the step's static ones already), and
    shapes never depend on values (stages.draft.refill_columns)."""
    return _inside("step")


def in_whole_step() -> bool:
    return getattr(_static, "kind", None) == "step"


def over_static_buffers() -> bool:
    """Whether this thread runs a forward over a bucket's static buffers (a graph's warm-up,
    capture or, on the CPU, its eager form), alone or inside a whole step: an attention
    backend that plans on the host plans such a forward once a bucket."""
    return getattr(_static, "kind", None) is not None


@dataclass(frozen=True)
class Bucket:
    seqs: int
    rows: int  # queries a sequence (k + 1, or a tree's nodes + 1)
    keys: int  # key slots a sequence
    tree: bool  # a mask [seqs, rows, keys] replaces the causal rule


def bucket_of(meta: AttentionMetadata) -> Bucket | None:
    """The bucket a forward over `meta` runs in; None past the largest batch."""
    b, lmax = meta.num_seqs, meta.kv_slots.shape[1]
    at = bisect.bisect_left(BATCH_BUCKETS, b)
    if at == len(BATCH_BUCKETS):
        return None
    keys = MIN_KEYS
    while keys < lmax:
        keys *= 2
    return Bucket(BATCH_BUCKETS[at], meta.max_q, keys, meta.mask is not None)


class StaticInputs:
    """One bucket's buffers: what a forward reads, filled anew each step."""

    def __init__(self, bucket: Bucket, device: torch.device, scratch_slot: int):
        b, r, n = bucket.seqs, bucket.rows, bucket.keys
        self.bucket = bucket
        self.scratch_slot = scratch_slot
        self.ids = torch.zeros(b * r, dtype=torch.int64, device=device)  # [B * R]
        self.positions = torch.zeros(b * r, dtype=torch.int64, device=device)  # [B * R]
        self.slot_mapping = torch.full((b * r,), scratch_slot, dtype=torch.int64, device=device)
        self.kv_slots = torch.full((b, n), scratch_slot, dtype=torch.int64, device=device)
        self.kv_lens = torch.ones(b, dtype=torch.int64, device=device)  # [B]
        self.q_index = torch.arange(b * r, device=device)  # [B * R] every row its own query
        # [B, R, keys]; a padding row sees its one key
        self.mask = torch.zeros(b, r, n, dtype=torch.bool, device=device) if bucket.tree else None
        if self.mask is not None:
            self.mask[:, :, 0] = True
        self.extra: list[torch.Tensor] = []  # [B * R, ...] the forward's other inputs

    def fill(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        extra: tuple[torch.Tensor, ...] = (),  # [T, ...] each (a head's features)
    ) -> int:
        """Copy a step's inputs in, the rows past them reset to padding (an earlier step's
        sequences must not write there); returns the step's rows. Key slots past a
        sequence's own keep whatever they held: its key count masks them."""
        t, (b, lmax) = ids.shape[0], meta.kv_slots.shape
        self.ids[:t].copy_(ids)
        self.positions[:t].copy_(positions)
        self.slot_mapping[:t].copy_(meta.slot_mapping)
        self.kv_slots[:b, :lmax].copy_(meta.kv_slots)
        self.kv_lens[:b].copy_(meta.kv_lens)
        if t < self.ids.shape[0]:
            self.ids[t:] = 0
            self.positions[t:] = 0
            self.slot_mapping[t:] = self.scratch_slot
            self.kv_slots[b:] = self.scratch_slot
            self.kv_lens[b:] = 1
        if self.mask is not None:
            assert meta.mask is not None
            self.mask[:b, :, :lmax].copy_(meta.mask)
            self.mask[:b, :, lmax:] = False
            self.mask[b:] = False
            self.mask[b:, :, 0] = True
        if not self.extra:  # padding rows: zeros, then whatever an earlier step left (finite)
            rows = self.ids.shape[0]
            self.extra = [x.new_zeros(rows, *x.shape[1:]) for x in extra]
        for buffer, x in zip(self.extra, extra, strict=True):
            buffer[:t].copy_(x)
        return t

    def args(self) -> tuple:
        """The forward's arguments: ids, positions, metadata, the other inputs."""
        return (self.ids, self.positions, self.metadata(), *self.extra)

    def metadata(self) -> AttentionMetadata:
        b, r = self.bucket.seqs, self.bucket.rows
        return AttentionMetadata(
            slot_mapping=self.slot_mapping,
            kv_slots=self.kv_slots,
            kv_lens=self.kv_lens,
            q_index=self.q_index,
            q_positions=self.positions.view(b, r),
            mask=self.mask,
            shared=SharedKeys(),  # derived again at each call (each replay)
        )


class GraphedForward:
    """`forward` run over a bucket's static buffers: captured and replayed on CUDA
    (`capture`), eager elsewhere; a Forward itself. Outputs are the real rows' (copies on
    CUDA, where the next replay rewrites the graph's own)."""

    def __init__(self, forward: Forward, device: torch.device, scratch_slot: int, capture: bool):
        self.forward = forward
        self.device = device
        self.scratch_slot = scratch_slot
        self.capture = capture
        self.inputs: dict[Bucket, StaticInputs] = {}
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, made at the first capture

    def __call__(
        self,
        ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        *extra: torch.Tensor,  # [T, ...] the forward's other inputs, the same at every call
    ) -> tuple[torch.Tensor, ...]:
        """The forward's outputs, through a bucket where `meta` fits one, else eagerly."""
        bucket = bucket_of(meta)
        if bucket is None or meta.q_index.shape[0] != meta.num_seqs * meta.max_q:
            return self.forward(ids, positions, meta, *extra)  # a prefill chunk, a large batch
        if in_whole_step():  # inside the step's own graph
            return self.forward(ids, positions, meta, *extra)
        inputs = self.inputs.get(bucket)
        if inputs is None:
            inputs = self.inputs[bucket] = StaticInputs(bucket, self.device, self.scratch_slot)
        t = inputs.fill(ids, positions, meta, extra)
        if not self.capture:
            with _inside("forward"):
                return tuple(x[:t] for x in self.forward(*inputs.args()))
        if bucket not in self.graphs:
            self.graphs[bucket] = self._captured(inputs)
        graph, outputs = self.graphs[bucket]
        graph.replay()
        return tuple(x[:t].clone() for x in outputs)

    def _captured(self, inputs: StaticInputs) -> tuple[torch.cuda.CUDAGraph, tuple]:
        """The bucket's graph and its output tensors, captured on the current stream (the
        engine's compute stream: never the default one) without a host synchronisation
        (torch.cuda.graph's context makes one). Two warm-up forwards first, on a side stream,
        so that no lazy initialisation happens inside the capture; they rewrite the step's own
        keys and values with the same values. Other threads' CUDA calls go on meanwhile (the
        copies to the host): the capture forbids unsafe calls in this thread only."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), _inside("forward"):
            for _ in range(2):
                self.forward(*inputs.args())
        current.wait_stream(side)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            with _inside("forward"):
                outputs = self.forward(*inputs.args())
        finally:
            graph.capture_end()
        return graph, outputs
