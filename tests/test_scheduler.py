"""The scheduler alone, without a model: admission and chunking, the prefill/decode alternation,
page growth, preemption, and pages that return only after the steps that wrote them."""

from __future__ import annotations

from core.params import SamplingParams
from core.request import Request
from core.step import StepKind
from engine.scheduler import Scheduler
from kv.pages import PageAllocator

PAGE = 4


def request(name: str, prompt_len: int, arrival: float, max_tokens: int = 8) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return Request(name, list(range(1, prompt_len + 1)), params, 0, arrival)


def scheduler(pages: int = 64, max_running: int = 4, budget: int = 16, lookahead: int = 1):
    allocator = PageAllocator(pages)
    return Scheduler(allocator, PAGE, max_running, budget, lookahead, max_model_len=256)


def run_step(s: Scheduler, step: int, emitted: int = 1):
    """Schedule, plan and 'publish' one step as the engine would (every sequence of a decode
    step emits `emitted` tokens; a final prefill chunk emits one)."""
    batch = s.schedule(step)
    assert batch is not None
    emits = [
        batch.kind == StepKind.DECODE or seq.num_prefilled + chunk == len(seq.prefill_ids)
        for seq, chunk in zip(batch.seqs, batch.chunks, strict=True)
    ]
    s.planned(batch, emits)
    for seq, emitting in zip(batch.seqs, emits, strict=True):
        seq.request.inflight -= 1
        seq.num_pending -= int(emitting)
        seq.num_tokens += emitted if emitting else 0
    s.allocator.release(step)
    return batch


def test_admission_chunks_prompts_to_the_token_budget_and_reserves_their_pages():
    s = scheduler(budget=6, lookahead=3)
    s.add(request("a", 5, 0.0))
    s.add(request("b", 3, 1.0))
    batch = s.schedule(0)
    assert batch.kind == StepKind.PREFILL
    assert [q.request.request_id for q in batch.seqs] == ["a", "b"] and batch.chunks == [5, 1]
    a, b = batch.seqs
    # the whole prompt and the first decode step's slots, at admission: 5 + 3 + 1 -> 3 pages
    assert len(a.table.pages) == 3 and len(b.table.pages) == 2
    assert a.row != b.row and not s.waiting
    s.planned(batch, [True, False])
    assert (a.num_prefilled, a.num_pending, a.request.inflight) == (5, 1, 1)
    assert (b.num_prefilled, b.num_pending, b.prefilling) == (1, 0, True)


def test_prefill_and_decode_steps_alternate_so_arrivals_cannot_starve_decodes():
    s = scheduler(budget=4)
    s.add(request("a", 3, 0.0))
    kinds = [run_step(s, 0).kind]
    s.add(request("b", 12, 1.0))  # three chunks of 4
    kinds += [run_step(s, step).kind for step in range(1, 7)]
    assert kinds == [StepKind.PREFILL] + [StepKind.DECODE, StepKind.PREFILL] * 3
    assert s.schedule(7).kind == StepKind.DECODE  # b is done prefilling: both decode
    assert len(s.running) == 2 and not s.waiting


def test_a_sequence_at_its_token_limit_is_not_scheduled():
    s = scheduler()
    s.add(request("a", 2, 0.0, max_tokens=2))
    run_step(s, 0)  # prefill: the first output token
    run_step(s, 1)  # decode: the second, the last one
    assert s.schedule(2) is None  # nothing left to plan until the engine finishes it


def test_decode_growth_preempts_the_youngest_and_requeues_it_by_arrival():
    s = scheduler(pages=5, budget=16, lookahead=1)
    s.add(request("old", 7, 0.0, max_tokens=32))  # 7 + 1 + 1 slots: 3 pages
    s.add(request("young", 3, 1.0, max_tokens=32))  # 3 + 1 + 1: 2 pages
    run_step(s, 0)
    assert s.allocator.num_free == 0
    step, preempted = 1, False
    while not preempted:  # old grows into a fourth page: young must give up its two
        batch = run_step(s, step)
        preempted = s.num_preemptions > 0
        step += 1
    assert [q.request.request_id for q in batch.seqs] == ["old"]
    assert [r.request_id for r in s.waiting] == ["young"]
    (old,) = s.running
    assert len(old.table.pages) == 4 and s.allocator.num_free == 1  # young's two came back


def test_released_pages_return_only_after_the_steps_that_wrote_them():
    s = scheduler(pages=8)
    s.add(request("a", 6, 0.0))
    batch = s.schedule(0)
    seq = batch.seqs[0]
    held = len(seq.table.pages)
    s.release(seq, 1)  # finished while step 0 may still write its pages
    assert s.allocator.num_free == 8 - held and s.allocator.num_parked == held
    s.allocator.release(0)
    assert s.allocator.num_free == 8 and seq not in s.running
    assert sorted(s.free_rows) == [0, 1, 2, 3]
