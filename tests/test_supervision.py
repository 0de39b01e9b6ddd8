"""Supervision: a fault fails the requests it can be traced to and no others; a hung or
failing engine stops serving (its failure set and signalled) instead of hanging."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

import engine.planner as planner_module
from core.params import SamplingParams
from core.request import EngineFailed, FinishReason
from tests.engine_util import make_config, running, token_ids

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]


def pages_free(engine) -> bool:
    return engine.allocator.num_free == engine.allocator.num_pages


@pytest.mark.parametrize("method", ["none", "draft"])
async def test_a_request_whose_plan_fails_fails_alone(tiny_target, method):
    """A request whose sampling tensors cannot be built (as top_k = 2^63 once overflowed
    there) errors; the batch-mates it was planned with finish as if it had never come."""
    draft = tiny_target if method == "draft" else None
    async with running(make_config(tiny_target, method, draft)) as engine:
        alone = [token_ids(await engine.generate(p, GREEDY)) for p in PROMPTS]
        build = engine.planner.sampling_tensors

        def hostile(seqs):
            if any(s.request.request_id == "hostile" for s in seqs):
                raise OverflowError("Python int too large to convert to C long")
            return build(seqs)

        engine.planner.sampling_tensors = hostile
        streams = [engine.submit(p, GREEDY) for p in PROMPTS[:2]]
        streams.append(engine.submit([9, 9], GREEDY, request_id="hostile"))
        streams.append(engine.submit(PROMPTS[2], GREEDY))
        ends = [[d async for d in s] for s in streams]
        bad = ends.pop(2)
        assert bad[-1].finish_reason is FinishReason.ERROR
        assert "could not be planned" in bad[-1].error and "OverflowError" in bad[-1].error
        assert [token_ids(e) for e in ends] == alone
        assert all(e[-1].finish_reason is FinishReason.LENGTH for e in ends)
        await engine.wait_idle()
        assert pages_free(engine) and engine.failure is None


async def test_a_plan_fault_of_the_step_fails_its_requests_and_the_next_step_runs(
    tiny_target, monkeypatch, caplog
):
    async with running(make_config(tiny_target)) as engine:
        faults = []
        make_plan = planner_module.make_plan

        def flaky(batch, step, *args, **kwargs):
            if step == 4 and not faults:  # the step's fault, whoever is in it
                faults.append(step)
                raise RuntimeError("injected plan fault")
            return make_plan(batch, step, *args, **kwargs)

        monkeypatch.setattr(planner_module, "make_plan", flaky)
        with caplog.at_level(logging.ERROR, logger="tandem.engine"):
            ends = await asyncio.gather(*(engine.generate(p, GREEDY) for p in PROMPTS))
        assert faults == [4]
        failed = [e for e in ends if e[-1].finish_reason is FinishReason.ERROR]
        assert failed and all("injected plan fault" in e[-1].error for e in failed)
        logged = [r for r in caplog.records if "could not be planned" in r.getMessage()]
        assert len(logged) == 1 and logged[0].exc_info is not None  # once, with the traceback
        again = await engine.generate(PROMPTS[0], GREEDY)
        assert again[-1].finish_reason is FinishReason.LENGTH
        await engine.wait_idle()
        assert pages_free(engine) and engine.failure is None


async def test_a_dead_loop_stops_the_engine(tiny_target, monkeypatch):
    async with running(make_config(tiny_target)) as engine:
        first = await engine.generate(PROMPTS[0], GREEDY)
        assert first[-1].finish_reason is FinishReason.LENGTH

        def broken(step, lookahead=None):
            raise AssertionError("scheduler invariant broken")

        monkeypatch.setattr(engine.scheduler, "schedule", broken)
        stream = engine.submit(PROMPTS[1], GREEDY)
        ends = [d async for d in stream]
        assert ends[-1].finish_reason is FinishReason.ERROR
        await asyncio.wait_for(engine.failed.wait(), 5)
        assert "plan loop failed" in engine.failure and "scheduler invariant" in engine.failure
        with pytest.raises(EngineFailed):
            engine.submit(PROMPTS[0], GREEDY)


async def test_the_watchdog_stops_a_hung_engine(tiny_target):
    hang = threading.Event()

    def stuck(stage, plan, dev):
        if stage == "verify" and not hang.is_set():
            time.sleep(2.0)  # the device thread hangs in a step

    async with running(make_config(tiny_target, watchdog_s=0.5, fault=stuck)) as engine:
        start = time.monotonic()
        deltas = await engine.generate(PROMPTS[0], GREEDY)
        assert deltas[-1].finish_reason is FinishReason.ERROR
        assert engine.failure is not None and "no step completed for 0.5 s" in engine.failure
        assert time.monotonic() - start < 2.0  # within the watchdog's bound, not the hang's
        hang.set()


async def test_the_circuit_breaker_opens_after_failed_steps(tiny_target):
    def sticky(stage, plan, dev):
        if stage == "verify":
            raise RuntimeError("device error: an illegal memory access")

    async with running(make_config(tiny_target, max_failed_steps=3, fault=sticky)) as engine:
        for _ in range(3):  # each request fails at least one step
            try:
                deltas = await engine.generate(PROMPTS[0], GREEDY)
            except EngineFailed:
                break
            assert deltas[-1].finish_reason is FinishReason.ERROR
        await asyncio.wait_for(engine.failed.wait(), 5)
        assert "3 steps in a row failed" in engine.failure


async def test_a_served_step_closes_the_breaker(tiny_target):
    armed = threading.Event()  # the next verify fails, once

    def once(stage, plan, dev):
        if stage == "verify" and armed.is_set():
            armed.clear()
            raise RuntimeError("transient")

    async with running(make_config(tiny_target, max_failed_steps=2, fault=once)) as engine:
        for _ in range(3):  # fail, serve, fail, serve...: never two failures in a row
            armed.set()
            assert (await engine.generate(PROMPTS[0], GREEDY))[-1].error is not None
            assert not armed.is_set()
            assert (await engine.generate(PROMPTS[0], GREEDY))[-1].error is None
        assert engine.failure is None
