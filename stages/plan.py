"""Plan: the host side of a step. Picks the batch and packs what the device needs.

Everything the CPU knows about a step (positions, slots, page-table CSR, prompt tokens, n-gram
drafts) goes into one int32 host buffer that reaches the device in one copy; tokens that exist
only on the device (sampled, drafted) are gathered there. Host buffers are double-buffered:
plan N+2 writes the buffer that step N copied from only after that copy has completed.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.device import Event, Stream
from engine.scheduler import Batch, Sequence
from kv.table import build_csr
from models.attention import AttentionMetadata, paged_metadata
from stages.insert import StepLayout


@dataclass
class DevicePlan:
    """The step's metadata on the device (unpacked from the uploaded buffer)."""

    rows: torch.Tensor  # [B] each sequence's row in the per-request device buffers
    input_ids: torch.Tensor  # [T] prefill tokens (decode steps gather theirs on the device)
    positions: torch.Tensor  # [T]
    target_meta: AttentionMetadata  # the target forward's attention over T tokens
    logits_index: torch.Tensor  # [B * W] rows of T whose logits are verified (W = k + 1)
    tail_slots: torch.Tensor  # [B, k + 2] slots of positions base .. base + k + 1
    base: torch.Tensor  # [B] position of each sequence's last target input before the draft
    emits: torch.Tensor  # [B] bool: the step samples a token for this sequence
    emit_index: torch.Tensor  # [E] the sequences that emit (all of them in a decode step)
    token_rows: torch.Tensor  # [T] each token's row in the per-request device buffers
    num_drafts: torch.Tensor  # [B] draft tokens allowed per sequence (<= k)
    prompt_lens: torch.Tensor  # [B] output tokens start here (penalties count them)
    host_drafts: torch.Tensor  # [B, k] drafts proposed on the host (n-gram), -1 where none
    unknown: torch.Tensor  # [B] 1: planned before the sequence's previous step was sampled
    last_token: torch.Tensor | None = None  # [B] decode: each sequence's next input token

    def insert_next_tokens(
        self, kernel: Callable, accepted: torch.Tensor, history: torch.Tensor, moves: bool
    ) -> None:
        """Decode steps, first thing on the device: the next input tokens, and the moves the
        host could not plan (stages/insert.py). accepted [R], history [R, Lh]: per-row state.
        Without `moves` (no sequence's previous step was still unknown to the host) there is
        nothing to move and only the tokens are read."""
        if not moves:
            self.last_token = history[self.rows, self.base]
            return
        b, width = self.tail_slots.shape[0], self.tail_slots.shape[1] - 1
        meta = self.target_meta
        layout = StepLayout(
            rows=self.rows,
            unknown=self.unknown,
            base=self.base,
            positions=self.positions.view(b, width),
            slots=meta.slot_mapping.view(b, width),
            q_positions=meta.q_positions,
            tail_slots=self.tail_slots,
            kv_slots=meta.kv_slots,
            kv_lens=meta.kv_lens,
        )
        self.last_token = kernel(layout, accepted, history)


@dataclass
class Plan:
    """One step, as decided on the host."""

    step: int
    kind: str  # "prefill" or "decode"
    seqs: list[Sequence]
    k: int  # draft tokens per sequence (0: no speculation this step)
    num_drafts: list[int]  # [B] per-sequence cap on accepted drafts (<= k)
    base: list[int]  # [B] position of each sequence's last target input token
    emits: list[bool]  # [B] whether the step samples a token for the sequence
    page_size: int
    uploaded: Event | None = None  # value: DevicePlan
    events: dict[str, Event] = field(default_factory=dict)  # each device stage's completion
    sampling: Any = None  # SamplingTensors of the batch, on the device
    top_logprobs: int | None = None  # top-n logprobs wanted by some request of the batch
    fields: dict = field(default_factory=dict)  # host-side sections, kept for tests and traces
    device_seconds: float = 0.0  # the step's device work, summed over its stages
    unknown: list[int] = field(default_factory=list)  # [B] see DevicePlan.unknown

    @property
    def batch_size(self) -> int:
        return len(self.seqs)

    @property
    def width(self) -> int:
        return self.k + 1

    @property
    def max_q(self) -> int:
        return max(_lengths(self.fields["qo_indptr"]), default=1)

    @property
    def max_kv(self) -> int:
        pages = max(_lengths(self.fields["kv_indptr"]), default=1)
        return pages * self.page_size

    @property
    def num_tokens(self) -> int:
        return len(self.fields.get("positions", ()))

    def device(self) -> DevicePlan:
        """The uploaded metadata; stream work only (it blocks until the upload is done)."""
        assert self.uploaded is not None
        return self.uploaded.result()


def _lengths(indptr: list[int]) -> list[int]:
    return [b - a for a, b in zip(indptr, indptr[1:], strict=False)]


class HostBuffers:
    """Two pinned int32 host buffers used in turn, each reused only after its last upload. On
    the CPU there is nothing to stage: an upload is the tensor itself."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        count = 2 if device.type == "cuda" else 0  # the CPU stages nothing
        self.buffers = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(count)]
        self.uploads: list[Event | None] = [None, None]

    async def upload(self, step: int, values: list[int], stream: Stream | None) -> Event:
        """Copy `values` to the device through buffer step % 2; the event's value is the copy.
        Without a stream (a CPU device) the tensor is made here, at once."""
        if stream is None:  # frombuffer: a quarter of torch.tensor's cost on a list
            return Event.completed(torch.frombuffer(array("i", values), dtype=torch.int32))
        i = step % 2
        previous = self.uploads[i]
        if previous is not None:
            await previous  # its copy must have read the buffer before it is rewritten
        if len(values) > self.buffers[i].numel():
            self.buffers[i] = torch.empty(2 * len(values), dtype=torch.int32, pin_memory=True)
        host = self.buffers[i]
        host[: len(values)] = torch.tensor(values, dtype=torch.int32)
        n, device = len(values), self.device
        event = stream.submit(lambda: host[:n].to(device, non_blocking=True).clone())
        self.uploads[i] = event
        return event


def make_plan(
    batch: Batch,
    step: int,
    k: int,
    page_size: int,
    host_drafts: list[list[int]] | None = None,
    unknown: list[int] | None = None,
) -> Plan:
    """Host-side sections of a step; `host_drafts` [B][<= k] come from an n-gram drafter;
    `unknown` [B] marks decoding sequences whose previous step the host has not seen yet."""
    if batch.kind == "prefill":
        return _prefill_plan(batch, step, page_size)
    return _decode_plan(batch, step, k, page_size, host_drafts, unknown or [0] * len(batch.seqs))


@dataclass
class _Columns:
    """Per-token and per-sequence lists a plan packs."""

    ids: list[int] = field(default_factory=list)  # [T] prefill tokens
    positions: list[int] = field(default_factory=list)  # [T]
    slots: list[int] = field(default_factory=list)  # [T]
    logits_index: list[int] = field(default_factory=list)  # [B * W]
    q_lens: list[int] = field(default_factory=list)  # [B]
    kv_lens: list[int] = field(default_factory=list)  # [B] keys after this step's writes
    tails: list[list[int]] = field(default_factory=list)  # [B][k + 2]


def _prefill_plan(batch: Batch, step: int, page_size: int) -> Plan:
    c, base, emits = _Columns(), [], []
    for seq, chunk in zip(batch.seqs, batch.chunks, strict=True):
        start, end = seq.num_prefilled, seq.num_prefilled + chunk
        final = end == len(seq.prefill_ids)
        c.ids += seq.prefill_ids[start:end]
        c.positions += range(start, end)
        c.slots += seq.table.slots(start, end)
        c.logits_index.append(len(c.positions) - 1)
        c.q_lens.append(chunk)
        c.kv_lens.append(end + 1 if final else end)  # a final chunk's tail: the sampled token
        c.tails.append(seq.table.slots(end - 1, end + 1) if final else [0, 0])
        emits.append(final)
        base.append(end - 1)
    plan = Plan(step, "prefill", batch.seqs, 0, [0] * len(emits), base, emits, page_size)
    plan.fields = _sections(plan, c, [[]] * len(emits))
    return plan


def _decode_plan(
    batch: Batch,
    step: int,
    k: int,
    page_size: int,
    host_drafts: list[list[int]] | None,
    unknown: list[int],
) -> Plan:
    c, base, num_drafts = _Columns(), [], []
    for i, seq in enumerate(batch.seqs):
        n = seq.planned_tokens
        num_drafts.append(draft_cap(seq, k))
        base.append(n - 1)
        c.positions += range(n - 1, n + k)
        c.slots += seq.table.slots(n - 1, n + k)
        c.logits_index += range(i * (k + 1), (i + 1) * (k + 1))
        c.q_lens.append(k + 1)
        # an unknown previous step may have accepted a draft: count the key it would add, so
        # that the pages cover both cases (the insert kernel settles it on the device)
        c.kv_lens.append(n + k + 1 + unknown[i])
        c.tails.append(seq.table.slots(n - 1, n + k + 1))
    plan = Plan(step, "decode", batch.seqs, k, num_drafts, base, [True] * len(base), page_size)
    plan.unknown = unknown
    plan.fields = _sections(plan, c, host_drafts or [[]] * len(base))
    return plan


def draft_cap(seq: Sequence, k: int) -> int:
    """Draft tokens a decode step may verify for `seq`: at most k, its own
    num_speculative_tokens, and never past max_tokens (a step emits up to drafts + 1)."""
    params = seq.request.params
    remaining = params.max_tokens - (seq.planned_tokens - len(seq.request.prompt_ids))
    cap = k if params.num_speculative_tokens is None else params.num_speculative_tokens
    return max(0, min(k, remaining - 1, cap))


def _sections(plan: Plan, c: _Columns, drafts: list[list[int]]) -> dict[str, list[int]]:
    csr = build_csr([s.table for s in plan.seqs], c.kv_lens, c.q_lens)
    return {
        "rows": [s.row for s in plan.seqs],
        "input_ids": c.ids,
        "positions": c.positions,
        "slot_mapping": c.slots,
        "qo_indptr": csr.qo_indptr,
        "kv_indptr": csr.kv_indptr,
        "kv_indices": csr.kv_indices,
        "kv_last_page_len": csr.kv_last_page_len,
        "logits_index": c.logits_index,
        "tail_slots": [x for tail in c.tails for x in _pad(tail, plan.k + 2, 0)],
        "base": plan.base,
        "emits": [int(e) for e in plan.emits],
        "emit_index": [i for i, e in enumerate(plan.emits) if e],
        "num_drafts": plan.num_drafts,
        "prompt_lens": [len(s.request.prompt_ids) for s in plan.seqs],
        "host_drafts": [x for d in drafts for x in _pad(d, plan.k, -1)],
        "unknown": plan.unknown or [0] * len(plan.seqs),
    }


def _pad(values: list[int], width: int, fill: int) -> list[int]:
    return (list(values) + [fill] * width)[:width]


def drafter_metadata(
    dev: DevicePlan,
    index: torch.Tensor | None,  # [E] sequences taking part (None: all)
    positions: torch.Tensor,  # [E, m] query positions
    slots: torch.Tensor,  # [E, m] slots the m tokens write
) -> AttentionMetadata:
    """Attention for a drafter forward of m tokens per sequence inside a step: it reuses the
    step's key slots (they cover every position the step writes); causality by position hides
    the keys past each query."""
    meta = dev.target_meta
    kv_slots, kv_lens, shared = meta.kv_slots, meta.kv_lens, meta.shared
    if index is not None:  # other keys: nothing to share with the step's forwards
        kv_slots, kv_lens, shared = kv_slots[index], kv_lens[index], {}
    e, m = positions.shape
    return AttentionMetadata(
        slot_mapping=slots.flatten(),
        kv_slots=kv_slots,
        kv_lens=kv_lens,
        q_index=torch.arange(e * m, device=positions.device),
        q_positions=positions,
        shared=shared,
    )


def pack(sections: dict[str, list[int]]) -> tuple[list[int], dict[str, int]]:
    """One flat int list: the sections one after another; and each section's length."""
    flat: list[int] = []
    for values in sections.values():
        flat += values
    return flat, {name: len(values) for name, values in sections.items()}


def unpack(plan: Plan, uploaded: Event, layout: dict[str, int]) -> DevicePlan:
    """Device tensors from the uploaded buffer; runs as device work after the upload."""
    buf = uploaded.result().long()
    t = dict(zip(layout, buf.split(list(layout.values())), strict=True))
    b, width = plan.batch_size, plan.k + 2
    meta = paged_metadata(
        t["qo_indptr"],
        t["kv_indptr"],
        t["kv_indices"],
        t["kv_last_page_len"],
        t["positions"],
        t["slot_mapping"],
        plan.page_size,
        plan.max_q,
        plan.max_kv,
    )
    return DevicePlan(
        rows=t["rows"],
        input_ids=t["input_ids"],
        positions=t["positions"],
        target_meta=meta,
        logits_index=t["logits_index"],
        tail_slots=t["tail_slots"].view(b, width),
        base=t["base"],
        emits=t["emits"].bool(),
        emit_index=t["emit_index"],
        token_rows=t["rows"][torch.div(meta.q_index, meta.max_q, rounding_mode="floor")],
        num_drafts=t["num_drafts"],
        prompt_lens=t["prompt_lens"],
        host_drafts=t["host_drafts"].view(b, plan.k),
        unknown=t["unknown"],
    )
