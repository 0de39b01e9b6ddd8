"""The insert kernel: a hand-built case, and Triton (interpreted on the CPU) equal to torch."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from stages.insert import StepLayout, insert_torch


def layout(
    batch: int, width: int, rows: int, seed: int
) -> tuple[StepLayout, torch.Tensor, torch.Tensor]:
    """A random decode step: per-sequence key slots, bases, the host's a = 0 positions."""
    g = torch.Generator().manual_seed(seed)
    keys = 40
    kv_slots = torch.randperm(4000, generator=g)[: batch * keys].view(batch, keys)
    base = torch.randint(0, keys - width - 2, (batch,), generator=g)
    positions = base[:, None] + torch.arange(width)
    step_rows = torch.randperm(rows, generator=g)[:batch]
    s = StepLayout(
        rows=step_rows,
        unknown=torch.randint(0, 2, (batch,), generator=g),
        base=base,
        positions=positions,
        slots=kv_slots.gather(1, positions),
        q_positions=positions.clone(),
        tail_slots=kv_slots.gather(1, base[:, None] + torch.arange(width + 1)),
        kv_slots=kv_slots,
        kv_lens=base + width + 1,
    )
    accepted = torch.randint(0, 2, (rows,), generator=g)
    history = torch.randint(0, 500, (rows, keys), generator=g)
    return s, accepted, history


def copy(s: StepLayout) -> StepLayout:
    return StepLayout(**{f.name: getattr(s, f.name).clone() for f in dataclasses.fields(s)})


def test_a_sequence_moves_by_its_unknown_acceptance():
    s, accepted, history = layout(batch=3, width=2, rows=5, seed=0)
    s.unknown = torch.tensor([1, 1, 0])
    accepted[s.rows] = torch.tensor([1, 0, 1])  # only the first moves
    before = copy(s)
    tokens = insert_torch(s, accepted, history)
    moved = torch.tensor([1, 0, 0])
    assert torch.equal(s.base, before.base + moved)
    assert torch.equal(s.positions, before.positions + moved[:, None])
    assert torch.equal(s.q_positions, s.positions)
    assert torch.equal(s.slots, s.kv_slots.gather(1, s.positions))
    assert torch.equal(s.tail_slots[:, 0], s.kv_slots.gather(1, s.base[:, None])[:, 0])
    assert torch.equal(s.kv_lens, before.kv_lens + moved - s.unknown)
    assert torch.equal(tokens, history[s.rows, s.base])


@pytest.mark.parametrize("batch, width, seed", [(1, 2, 0), (7, 2, 1), (16, 5, 2), (33, 9, 3)])
def test_triton_kernel_equals_torch(monkeypatch, batch, width, seed):
    """Compiled on CUDA (tests/gpu/check.sh), interpreted on a CPU."""
    pytest.importorskip("triton", reason="the test environment installs triton")
    cuda = torch.cuda.is_available()
    if not cuda:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # before the kernel is built (on first use)
    from stages.insert import insert_triton

    s, accepted, history = layout(batch, width, rows=40, seed=seed)
    if cuda:
        s = StepLayout(**{f.name: getattr(s, f.name).cuda() for f in dataclasses.fields(s)})
        accepted, history = accepted.cuda(), history.cuda()
    want = copy(s)
    want_tokens = insert_torch(want, accepted, history)
    got_tokens = insert_triton(s, accepted, history)
    assert torch.equal(got_tokens, want_tokens)
    for f in dataclasses.fields(s):
        assert torch.equal(getattr(s, f.name), getattr(want, f.name)), f.name
