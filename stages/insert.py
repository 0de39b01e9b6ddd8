"""The insert kernel: a decode step's first device work, before the draft.

It writes each sequence's next input token (the last token committed so far, read from the
device's token history) into the step, and moves the step to where the previous step's
acceptance left the sequence. That second part is what MTP's one-token mode needs: the host
plans step N+1 before step N's accepted lengths reach it, assuming none of N's drafts were
accepted, and marks the sequences whose previous step was still in flight (`unknown`). On the
device, each of those moves on by that step's accepted count a: its positions, the slots its
tokens write, the tail slots, its key count (the host counted one key more than the a = 0 case,
so that its pages cover both) and its base. Nothing waits for the host. With every `unknown`
zero (the other modes) only the token is written.

Triton on CUDA (one program per sequence); the torch version everywhere else. Both are
tested equal under TRITON_INTERPRET=1.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from core.step import DevicePlan


@dataclass
class StepLayout:
    """The decode step's per-sequence metadata the kernel moves (all int64, updated in place)."""

    rows: torch.Tensor  # [B] each sequence's row in the per-row device state
    unknown: torch.Tensor  # [B] 1: the previous step's acceptance is unknown to the host
    base: torch.Tensor  # [B] position of the last committed token
    positions: torch.Tensor  # [B, W] positions of the step's tokens
    slots: torch.Tensor  # [B, W] slots they write
    q_positions: torch.Tensor  # [B, W] the attention's positions (may be `positions` itself)
    tail_slots: torch.Tensor  # [B, W + 1] slots of positions base .. base + W
    kv_slots: torch.Tensor  # [B, L] slot of each key position (read only)
    kv_lens: torch.Tensor  # [B] keys each sequence attends to after the step's writes


def insert_torch(layout: StepLayout, accepted: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
    """accepted [R]: each row's accepted count in its last step; history [R, Lh] tokens.
    Returns [B] each sequence's next input token."""
    s = layout
    a = accepted[s.rows] * s.unknown  # [B]
    s.base += a
    s.positions += a[:, None]
    s.q_positions.copy_(s.positions)
    s.slots.copy_(s.kv_slots.gather(1, s.positions))
    width = s.tail_slots.shape[1]
    tail = s.base[:, None] + torch.arange(width, device=a.device)
    s.tail_slots.copy_(s.kv_slots.gather(1, tail))
    s.kv_lens += a - s.unknown
    return history[s.rows, s.base]


def insert_triton(
    layout: StepLayout, accepted: torch.Tensor, history: torch.Tensor
) -> torch.Tensor:
    """The same, as one Triton program per sequence."""
    import triton

    s = layout
    batch, width = s.positions.shape
    tensors = (s.positions, s.slots, s.q_positions, s.tail_slots, s.kv_slots, history)
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError("the insert kernel needs contiguous tensors")
    out = torch.empty_like(s.base)
    _kernel()[(batch,)](
        s.rows,
        s.unknown,
        accepted,
        history,
        history.stride(0),
        s.base,
        s.positions,
        s.slots,
        s.q_positions,
        s.tail_slots,
        s.kv_slots,
        s.kv_slots.stride(0),
        s.kv_lens,
        out,
        WIDTH=width,
        BLOCK=triton.next_power_of_2(width + 1),
    )
    return out


@functools.cache
def _kernel() -> Any:
    """Built on first use, so that TRITON_INTERPRET set by then takes effect."""
    import triton
    import triton.language as tl

    @triton.jit
    def insert(
        rows,
        unknown,
        accepted,
        history,
        history_stride,
        base,
        positions,
        slots,
        q_positions,
        tail_slots,
        kv_slots,
        kv_stride,
        kv_lens,
        out,
        WIDTH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        row = tl.load(rows + b)
        u = tl.load(unknown + b)
        a = tl.load(accepted + row) * u
        new_base = tl.load(base + b) + a
        tl.store(base + b, new_base)
        j = tl.arange(0, BLOCK)
        step = j < WIDTH
        pos = tl.load(positions + b * WIDTH + j, mask=step, other=0) + a
        tl.store(positions + b * WIDTH + j, pos, mask=step)
        tl.store(q_positions + b * WIDTH + j, pos, mask=step)
        slot = tl.load(kv_slots + b * kv_stride + pos, mask=step, other=0)
        tl.store(slots + b * WIDTH + j, slot, mask=step)
        tail = j < WIDTH + 1
        tail_slot = tl.load(kv_slots + b * kv_stride + new_base + j, mask=tail, other=0)
        tl.store(tail_slots + b * (WIDTH + 1) + j, tail_slot, mask=tail)
        tl.store(kv_lens + b, tl.load(kv_lens + b) + a - u)
        tl.store(out + b, tl.load(history + row * history_stride + new_base))

    return insert


def insert_kernel(device: torch.device):
    """Triton on CUDA when it is installed; torch otherwise."""
    if device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return insert_torch
        return insert_triton
    return insert_torch


def next_tokens(
    dev: DevicePlan,
    kernel: Any,  # insert_kernel(device)
    accepted: torch.Tensor,  # [R] drafts accepted in each row's latest step
    history: torch.Tensor,  # [R, Lh] each row's tokens
    moves: bool,
) -> torch.Tensor:
    """[B] a decode step's input tokens, first thing on the device, after the moves the host
    could not plan. Without `moves` (no sequence's previous step was still unknown to the
    host when it planned) there is nothing to move and only the tokens are read."""
    if not moves:
        return history[dev.rows, dev.base]
    b, width = dev.tail_slots.shape[0], dev.tail_slots.shape[1] - 1
    meta = dev.target_meta
    layout = StepLayout(
        rows=dev.rows,
        unknown=dev.unknown,
        base=dev.base,
        positions=dev.positions.view(b, width),
        slots=meta.slot_mapping.view(b, width),
        q_positions=meta.q_positions,
        tail_slots=dev.tail_slots,
        kv_slots=meta.kv_slots,
        kv_lens=meta.kv_lens,
    )
    return kernel(layout, accepted, history)
