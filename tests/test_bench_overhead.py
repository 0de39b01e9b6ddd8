"""bench.overhead: how it splits a step's time, how it clocks forwards, and a tiny run."""

from __future__ import annotations

import json

import pytest
import torch

from bench import overhead


def decode_records(ends: list[float], stage_spans: dict[int, dict[str, tuple[float, float]]]):
    """A timeline of full-batch (size 1) decode steps: step s's refill ends at ends[s]."""
    records = []
    for step, end in enumerate(ends):
        records.append({"step": step, "stage": "plan", "kind": "decode", "batch_size": 1,
                        "num_tokens": 3})  # fmt: skip
        spans = stage_spans.get(step, {"refill": (end - 0.1, end)})
        records += [
            {"step": step, "stage": st, "start": a, "end": b} for st, (a, b) in spans.items()
        ]
    return records


def test_a_step_splits_into_stages_their_forwards_and_the_time_between():
    # step 1 runs 1.0 .. 2.0: upload 0.1, draft 0.2 (a 0.15 forward), verify 0.5 (0.45),
    # sample 0.05, refill 0.1 (0.08); 0.05 between the stages
    spans = {1: {"upload": (1.05, 1.15), "draft": (1.15, 1.35), "verify": (1.35, 1.85),
                 "sample": (1.85, 1.9), "refill": (1.9, 2.0)}}  # fmt: skip
    intervals = [(1.16, 1.31), (1.36, 1.81), (1.91, 1.99), (2.5, 2.6)]  # the last: no stage
    split = overhead.split_steps(decode_records([1.0, 2.0, 3.0], spans), intervals, batch=1)
    # steps 1 and 2 are timed (step 0 has no decode step before it); step 2 has only a refill
    assert split["step"] == pytest.approx((1.0 + 1.0) / 2)
    assert split["draft_forwards"] == pytest.approx(0.15 / 2)
    assert split["verify"] == pytest.approx(0.5 / 2)
    assert split["in_forwards"] == pytest.approx((0.15 + 0.45 + 0.08) / 2)
    assert split["between"] == pytest.approx((0.05 + 0.9) / 2)


def test_the_forward_clock_keeps_outermost_calls_while_recording():
    inner = torch.nn.Linear(4, 4)
    outer = torch.nn.Sequential(inner, torch.nn.ReLU())
    clock = overhead.ForwardClock([outer, inner, inner])  # a module given twice hooks once
    outer(torch.zeros(1, 4))
    assert clock.intervals == []
    clock.recording = True
    outer(torch.zeros(1, 4))
    inner(torch.zeros(1, 4))
    assert len(clock.intervals) == 2
    assert all(start <= end for start, end in clock.intervals)


def test_tiny_run_splits_the_overhead_exactly(tmp_path, tiny_target, capsys):
    out = tmp_path / "overhead.json"
    argv = ["--model", str(tiny_target), "--draft-model", str(tiny_target),
            "--methods", "none", "draft", "--repeats", "1", "--max-tokens", "13", "--k", "2",
            "--out", str(out)]  # fmt: skip
    rows = overhead.run(overhead.parse_args(argv))
    assert [r["method"] for r in rows] == ["none", "draft"]
    for r in rows:
        parts = r["slower_ms"] + r["host_ms"] + r["between_ms"]
        assert r["step_ms"] - r["alone_ms"] == pytest.approx(parts)
        assert r["efficiency"] == pytest.approx(r["alone_ms"] / r["step_ms"])
        assert r["in_engine_ms"] > 0 and r["stages_ms"]["verify"][1] > 0
    draft = rows[1]
    assert draft["stages_ms"]["draft"][1] > 0  # the draft model ran inside the draft stage
    assert rows[0]["stages_ms"]["draft"][1] == 0
    assert json.loads(out.read_text())["rows"] == rows
    assert "| draft |" in capsys.readouterr().out
