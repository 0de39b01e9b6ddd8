"""MTP's one-token step as one graph (`--cuda-graphs` with `--speculative mtp`, k = 1).

In MTP's one-token mode the host plans step N + 1 before step N is sampled, and the insert
kernel settles on the device where step N's acceptance left each sequence
(stages/insert.py): nothing in a step waits for the host. Its device work, the insert, the
head's draft, the target's verify, the sample and the head's refill, is then captured whole as
one CUDA graph per key and replayed each step: one launch where the stages made a few hundred.
The host reads the verdict one step late, as the pipelined loop does anyway.

A key is a bucket (sequences up to one of BATCH_BUCKETS, keys up to a power of two, as the
forwards' graphs have them: models/graphs.py), the step's width and the batch's sampling
flags, which choose the sampler's code path. Each step's DevicePlan is copied into its key's
static one: rows past the batch take the scratch row of the per-request state, the KV cache's
scratch slot and the first row's sampling parameters (so that the flags hold for them too). A
key's first WARM_UPS steps run eagerly over the static plan (on a side stream: what
initialises lazily does so outside the capture), then the key is captured; on the CPU every
step runs eagerly over the static plan, so the tests hold what is captured to plain decoding.

Steps that run the stages one by one instead (`takes`): prefills, a batch past the largest
bucket, and any batch with a request that has a grammar (its masks are walked on the host) or
asks for logprobs (their count shapes the outputs). Penalties, logit_bias, top-k/p, min-p,
seeds and stop strings (the host's) stay in the graph.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from core.attention_metadata import AttentionMetadata, SharedKeys
from core.params import SamplingTensors
from core.step import DevicePlan, Plan, StepKind, Verdict
from models.graphs import BATCH_BUCKETS, MIN_KEYS, whole_step

log = logging.getLogger("tandem.engine")

WARM_UPS = 2  # eager steps of a key before it is captured

# (plan, device plan) -> (verdict, the drafter's refill columns): the step's device stages, in
# the executor's order (Executor._whole_step_body)
Body = Callable[[Plan, DevicePlan], tuple[Verdict, int]]


@dataclass(frozen=True)
class StepKey:
    seqs: int  # sequences the bucket holds
    width: int  # rows a sequence: k + 1 (2 in one-token mode)
    keys: int  # key slots a sequence
    flags: tuple[bool, ...]  # the sampling flags (sampling_flags)


def sampling_flags(st: SamplingTensors) -> tuple[bool, ...]:
    """What chooses the sampler's code path (the host-side flags and which optional tensors
    exist): two batches with the same flags run the same operations."""
    return (
        st.all_greedy,
        st.any_greedy,
        st.any_penalty,
        st.any_top_k_or_p,
        st.any_min_p,
        st.logit_bias is not None,
        st.coupled is not None,
    )


class StaticStep:
    """One key's static DevicePlan and padded Plan, filled anew each step."""

    def __init__(self, key: StepKey, plan: Plan, dev: DevicePlan, scratch_slot: int, row: int):
        b, w, device = key.seqs, plan.width, dev.rows.device
        self.key, self.scratch_slot, self.scratch_row = key, scratch_slot, row
        longs = lambda n, fill: torch.full((n,), fill, dtype=torch.long, device=device)  # noqa: E731
        empty = longs(0, 0)
        positions = longs(b * w, 0)
        self.dev = DevicePlan(
            rows=longs(b, row),
            input_ids=empty,
            positions=positions,
            target_meta=AttentionMetadata(
                slot_mapping=longs(b * w, scratch_slot),
                kv_slots=torch.full((b, key.keys), scratch_slot, dtype=torch.long, device=device),
                kv_lens=longs(b, 1),
                q_index=torch.arange(b * w, device=device),
                q_positions=positions.view(b, w),
            ),
            logits_index=torch.arange(b * w, device=device),
            tail_slots=torch.full((b, w + 1), scratch_slot, dtype=torch.long, device=device),
            base=longs(b, 0),
            emits=torch.ones(b, dtype=torch.bool, device=device),
            emit_index=torch.arange(b, device=device),
            token_rows=longs(b * w, row),
            num_drafts=longs(b, 0),
            prompt_lens=longs(b, 0),
            host_drafts=torch.full((b, plan.k), -1, dtype=torch.long, device=device),
            unknown=longs(b, 0),
            cached_rows=empty,
            cached_positions=empty,
            cached_ids=empty,
            catch_up_end=empty,
            sampling=_static_sampling(dev.sampling, b),
        )
        # what the stages read from the host plan: its k and width, its batch size
        self.plan = dataclasses.replace(
            plan, step=-1, seqs=[], fields={"rows": [row] * b}, drafted_by=None
        )

    def fill(self, dev: DevicePlan) -> int:
        """Copy a step's plan in, the rows past it reset to padding (an earlier step's
        sequences must not write there); returns the step's sequences. Key slots past a
        sequence's own keep whatever they held: its key count masks them."""
        s, meta, static = self.dev, dev.target_meta, self.dev.target_meta
        b, lmax = meta.kv_slots.shape
        row, slot = self.scratch_row, self.scratch_slot
        padding = {"rows": row, "token_rows": row, "tail_slots": slot, "host_drafts": -1}
        for name in ("base", "positions", "num_drafts", "prompt_lens", "unknown"):
            padding[name] = 0
        for name, value in padding.items():
            _fill(getattr(s, name), getattr(dev, name), value)
        _fill(static.slot_mapping, meta.slot_mapping, slot)
        _fill(static.kv_lens, meta.kv_lens, 1)
        static.kv_slots[:b, :lmax].copy_(meta.kv_slots)
        static.kv_slots[b:] = slot
        for f in dataclasses.fields(SamplingTensors):
            value = getattr(s.sampling, f.name)
            if isinstance(value, torch.Tensor):
                source = getattr(dev.sampling, f.name)
                value[:b].copy_(source)
                value[b:] = source[:1]  # the first row's: the flags hold for every row
        s.target_meta = dataclasses.replace(static, shared=SharedKeys())  # derived anew
        return b


def _fill(static: torch.Tensor, values: torch.Tensor, padding: int) -> None:
    n = values.shape[0]
    static[:n].copy_(values)
    static[n:] = padding


def _static_sampling(st: SamplingTensors, rows: int) -> SamplingTensors:
    """Buffers of `rows` rows shaped like st's tensors, its flags kept."""
    tensors: dict[str, Any] = {
        f.name: getattr(st, f.name).new_empty((rows, *getattr(st, f.name).shape[1:]))
        for f in dataclasses.fields(st)
        if isinstance(getattr(st, f.name), torch.Tensor)
    }
    return dataclasses.replace(st, **tensors)


class StepGraph:
    """The body run over a key's static plan: captured and replayed on CUDA (`capture`),
    eager elsewhere."""

    def __init__(self, device: torch.device, scratch_slot: int, scratch_row: int, capture: bool):
        self.device = device
        self.scratch_slot = scratch_slot
        self.scratch_row = scratch_row
        self.capture = capture
        self.steps: dict[StepKey, StaticStep] = {}
        self.runs: dict[StepKey, int] = {}  # steps each key has run
        self.graphs: dict[StepKey, tuple[torch.cuda.CUDAGraph, Verdict, int]] = {}
        self.pool: Any = None  # the graphs' shared memory pool, made at the first capture
        self.eager = 0  # decode steps that ran the stages one by one (`takes` refused)
        self.captures: list[tuple[StepKey, float, int]] = []  # (key, seconds, pool bytes added)

    def takes(self, plan: Plan) -> bool:
        """Whether the step runs as one graph (the module's docstring says which do not)."""
        taken = (
            plan.kind == StepKind.DECODE
            and plan.batch_size <= BATCH_BUCKETS[-1]
            and plan.top_logprobs is None
            and all(s.request.matcher is None for s in plan.seqs)
        )
        if not taken and plan.kind == StepKind.DECODE:
            self.eager += 1
        return taken

    def __call__(self, plan: Plan, dev: DevicePlan, body: Body) -> tuple[Verdict, int]:
        """The step's verdict (its sequences' rows) and the refill's columns, `body` run over
        the key's static plan (the same body at every call)."""
        key = self.key_of(plan)
        step = self.steps.get(key)
        if step is None:
            step = self.steps[key] = StaticStep(key, plan, dev, self.scratch_slot, self.scratch_row)
        b = step.fill(dev)
        runs = self.runs[key] = self.runs.get(key, 0) + 1
        if not self.capture:
            with whole_step():
                verdict, columns = body(step.plan, step.dev)
            return _rows(verdict, b, clone=False), columns
        if key not in self.graphs and runs <= WARM_UPS:
            verdict, columns = self._warm_up(step, body)
            return _rows(verdict, b, clone=True), columns
        if key not in self.graphs:  # the capture runs nothing: the step is still to run
            self.graphs[key] = self._captured(step, body)
        graph, verdict, columns = self.graphs[key]
        graph.replay()
        return _rows(verdict, b, clone=True), columns

    def key_of(self, plan: Plan) -> StepKey:
        seqs = next(n for n in BATCH_BUCKETS if n >= plan.batch_size)
        keys = MIN_KEYS
        while keys < plan.max_kv:
            keys *= 2
        return StepKey(seqs, plan.width, keys, sampling_flags(plan.sampling))

    def _warm_up(self, step: StaticStep, body: Body) -> tuple[Verdict, int]:
        """One eager step on a side stream, which the compute stream then waits for."""
        current = torch.cuda.current_stream(self.device)
        side = torch.cuda.Stream(self.device)
        side.wait_stream(current)
        with torch.cuda.stream(side), whole_step():
            result = body(step.plan, step.dev)
        current.wait_stream(side)
        return result

    def _captured(self, step: StaticStep, body: Body) -> tuple[torch.cuda.CUDAGraph, Verdict, int]:
        """The key's graph and its outputs, captured on the current stream (the engine's
        compute stream) without a host synchronisation; timed, its memory logged."""
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        start, before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
        try:
            with whole_step():
                verdict, columns = body(step.plan, step.dev)
        finally:
            graph.capture_end()
        added = torch.cuda.memory_reserved(self.device) - before
        seconds = time.perf_counter() - start
        self.captures.append((step.key, seconds, added))
        log.info(
            "step graph of %d sequences and %d keys captured in %.3f s, its pool %d MiB larger",
            step.key.seqs,
            step.key.keys,
            seconds,
            added >> 20,
        )
        return graph, verdict, columns


def _rows(verdict: Verdict, b: int, clone: bool) -> Verdict:
    """The verdict of the step's b sequences (copies where a replay rewrites the graph's)."""
    values = {
        f.name: getattr(verdict, f.name)[:b].clone() if clone else getattr(verdict, f.name)[:b]
        for f in dataclasses.fields(verdict)
        if isinstance(getattr(verdict, f.name), torch.Tensor)
    }
    return dataclasses.replace(verdict, **values)
