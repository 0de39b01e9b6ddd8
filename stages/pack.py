"""A step's plan packed for the device: what the device needs for a batch, decided on the host
(make_plan, called by the engine's planner), packed into one buffer (pack) and read back on
the device (unpack), so that this module alone knows the buffer's layout.

Everything the CPU knows about a step (positions, slots, page-table CSR, prompt tokens, n-gram
drafts) goes into one int32 host buffer that reaches the device in one copy (the executor's
upload); tokens that exist only on the device (sampled, drafted) are gathered there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from core.attention_metadata import AttentionMetadata, SharedKeys
from core.params import SamplingTensors
from core.step import Batch, CatchUp, DevicePlan, Plan, Sequence, StepKind
from kv.table import build_csr
from models.attention import paged_metadata

Packed = tuple[list[int], dict[str, int]]  # pack's: the flat buffer, each section's length
# the plan's int32 sections, in the order make_plan writes them (engine/parallel.py sends
# their sizes in this order)
FIELDS = (
    "rows",
    "input_ids",
    "positions",
    "slot_mapping",
    "qo_indptr",
    "kv_indptr",
    "kv_indices",
    "kv_last_page_len",
    "logits_index",
    "tail_slots",
    "base",
    "emits",
    "emit_index",
    "num_drafts",
    "prompt_lens",
    "host_drafts",
    "unknown",
    "cached_rows",
    "cached_positions",
    "cached_ids",
    "catch_up_end",
)


def make_plan(
    batch: Batch,
    step: int,
    k: int,
    page_size: int,
    sampling: SamplingTensors,
    host_drafts: list[list[int] | None] | None = None,
    unknown: list[int] | None = None,
    drafter_refill: bool = True,
    catch_up: CatchUp | None = None,
    drafted_by: list[str] | None = None,
) -> Plan:
    """The step's plan: `sampling` holds the batch's parameters; `host_drafts` [B][<= k] come
    from the host (n-gram, suffix; None: a row the device drafts); `unknown` [B] marks
    decoding sequences whose previous step the host has not seen yet; `drafter_refill` and
    `catch_up` as Plan's. Changes no state."""
    b = len(batch.seqs)
    if batch.kind == StepKind.PREFILL:
        k, unknown, host_drafts = 0, [0] * b, None
        c, base, emits, num_drafts = _prefill_columns(batch)
    else:
        unknown = unknown or [0] * b
        c, base, num_drafts = _decode_columns(batch, k, unknown)
        emits = [True] * b
        if host_drafts is not None:  # no more drafts than proposed
            num_drafts = [
                n if d is None else min(n, len(d))
                for n, d in zip(num_drafts, host_drafts, strict=True)
            ]
    tables: list = [s.table for s in batch.seqs]  # kv.table.PageTable, seen through core
    csr = build_csr(tables, c.kv_lens, c.q_lens)
    drafts = [d or [] for d in host_drafts] if host_drafts else [[]] * b
    fields = {
        "rows": [s.row for s in batch.seqs],
        "input_ids": c.ids,
        "positions": c.positions,
        "slot_mapping": c.slots,
        "qo_indptr": csr.qo_indptr,
        "kv_indptr": csr.kv_indptr,
        "kv_indices": csr.kv_indices,
        "kv_last_page_len": csr.kv_last_page_len,
        "logits_index": c.logits_index,
        "tail_slots": [x for tail in c.tails for x in _pad(tail, k + 2, 0)],
        "base": base,
        "emits": [int(e) for e in emits],
        "emit_index": [i for i, e in enumerate(emits) if e],
        "num_drafts": num_drafts,
        "prompt_lens": [len(s.request.prompt_ids) for s in batch.seqs],
        "host_drafts": [x for d in drafts for x in _pad(d, k, -1)],
        "unknown": unknown,
        "cached_rows": c.cached_rows,
        "cached_positions": c.cached_positions,
        "cached_ids": c.cached_ids,
        "catch_up_end": catch_up.end if catch_up is not None else [],
    }
    wanted = [n for s in batch.seqs if (n := s.request.params.logprobs) is not None]
    top_logprobs = max(wanted) if wanted else None
    return Plan(
        step=step,
        kind=batch.kind,
        seqs=batch.seqs,
        k=k,
        num_drafts=num_drafts,
        base=base,
        emits=emits,
        unknown=unknown,
        page_size=page_size,
        sampling=sampling,
        top_logprobs=top_logprobs,
        fields=fields,
        drafter_refill=drafter_refill,
        catch_up=catch_up,
        drafted_by=drafted_by if batch.kind == StepKind.DECODE else None,
    )


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
    # a prefix-cache hit's tokens, for the token history: [C] each
    cached_rows: list[int] = field(default_factory=list)
    cached_positions: list[int] = field(default_factory=list)
    cached_ids: list[int] = field(default_factory=list)


def _prefill_columns(batch: Batch) -> tuple[_Columns, list[int], list[bool], list[int]]:
    """(columns, base, emits, num_drafts) of a prefill step."""
    c, base, emits = _Columns(), [], []
    for seq, chunk in zip(batch.seqs, batch.chunks, strict=True):
        start, end = seq.num_prefilled, seq.num_prefilled + chunk
        final = end == len(seq.prefill_ids)
        if start == seq.num_cached:  # the first chunk: the cached tokens join the history
            c.cached_rows += [seq.row] * start
            c.cached_positions += range(start)
            c.cached_ids += seq.prefill_ids[:start]
        c.ids += seq.prefill_ids[start:end]
        c.positions += range(start, end)
        c.slots += seq.table.slots(start, end)
        c.logits_index.append(len(c.positions) - 1)
        c.q_lens.append(chunk)
        c.kv_lens.append(end + 1 if final else end)  # a final chunk's tail: the sampled token
        c.tails.append(seq.table.slots(end - 1, end + 1) if final else [0, 0])
        emits.append(final)
        base.append(end - 1)
    return c, base, emits, [0] * len(emits)


def _decode_columns(
    batch: Batch, k: int, unknown: list[int]
) -> tuple[_Columns, list[int], list[int]]:
    """(columns, base, num_drafts) of a decode step."""
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
    return c, base, num_drafts


def draft_cap(seq: Sequence, k: int) -> int:
    """Draft tokens a decode step may verify for `seq`: at most k, its own
    num_speculative_tokens (none where its speculative_method is none), and never past
    max_tokens (a step emits up to drafts + 1)."""
    params = seq.request.params
    remaining = params.max_tokens - (seq.planned_tokens - len(seq.request.prompt_ids))
    cap = k if params.num_speculative_tokens is None else params.num_speculative_tokens
    if params.speculative_method == "none":
        cap = 0
    return max(0, min(k, remaining - 1, cap))


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
        kv_slots, kv_lens, shared = kv_slots[index], kv_lens[index], SharedKeys()
    e, m = positions.shape
    return AttentionMetadata(
        slot_mapping=slots.flatten(),
        kv_slots=kv_slots,
        kv_lens=kv_lens,
        q_index=torch.arange(e * m, device=positions.device),
        q_positions=positions,
        shared=shared,
    )


def pack(sections: dict[str, list[int]]) -> Packed:
    """One flat int list: the sections one after another; and each section's length."""
    flat: list[int] = []
    for values in sections.values():
        flat += values
    return flat, {name: len(values) for name, values in sections.items()}


def unpack(plan: Plan, buffer: torch.Tensor, layout: dict[str, int]) -> DevicePlan:
    """Device tensors from the uploaded int32 buffer (device work, after the upload)."""
    buf = buffer.long()
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
        cached_rows=t["cached_rows"],
        cached_positions=t["cached_positions"],
        cached_ids=t["cached_ids"],
        catch_up_end=t["catch_up_end"],
        sampling=plan.sampling.to(buffer.device),
    )
