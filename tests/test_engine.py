"""The engine end to end on tiny random models: batching, preemption, aborts, failures."""

from __future__ import annotations

import asyncio
import random

import pytest

from core.params import InvalidRequest, SamplingParams
from core.request import FinishReason
from tests.engine_util import make_config, ragged_prompts, running, staggered, token_ids

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


async def alone(config, prompts, params=GREEDY):
    async with running(config) as engine:
        return [token_ids(await engine.generate(p, params)) for p in prompts]


async def test_batched_greedy_equals_alone(tiny_target):
    prompts = ragged_prompts(16, 300)
    expected = await alone(make_config(tiny_target), prompts)
    async with running(make_config(tiny_target)) as engine:
        assert await staggered(engine, prompts, GREEDY) == expected
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_preemption_keeps_outputs(tiny_target):
    prompts = ragged_prompts(16, 300, seed=1)
    expected = await alone(make_config(tiny_target), prompts)
    async with running(make_config(tiny_target, pages=24, max_batch_tokens=64)) as engine:
        assert await staggered(engine, prompts, GREEDY) == expected
        assert engine.scheduler.num_preemptions > 0
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_chunked_prefill_matches(tiny_target):
    prompts = ragged_prompts(4, 300, seed=2)
    expected = await alone(make_config(tiny_target), prompts)
    assert await alone(make_config(tiny_target, max_batch_tokens=7), prompts) == expected


async def test_not_pipelined_matches(tiny_target):
    prompts = ragged_prompts(6, 300, seed=3)
    expected = await alone(make_config(tiny_target), prompts)
    async with running(make_config(tiny_target, pipelined=False)) as engine:
        assert await staggered(engine, prompts, GREEDY) == expected


async def test_device_delays_do_not_change_results(tiny_target):
    """Random delays in every stream: a missing wait between streams would show here."""
    prompts = ragged_prompts(6, 300, seed=4)
    expected = await alone(make_config(tiny_target), prompts)
    async with running(make_config(tiny_target, device_delay=0.003)) as engine:
        assert await staggered(engine, prompts, GREEDY) == expected


async def test_seeded_sampling_is_reproducible_in_any_batch(tiny_target):
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1234, ignore_eos=True)
    prompt = [5, 6, 7]
    async with running(make_config(tiny_target)) as engine:
        solo = token_ids(await engine.generate(prompt, params))
        others = [SamplingParams(max_tokens=16, temperature=1.0, seed=s) for s in range(5)]
        crowd = await asyncio.gather(
            engine.generate(prompt, params), *(engine.generate([9, 9], p) for p in others)
        )
    assert token_ids(crowd[0]) == solo
    assert any(token_ids(c) != solo for c in crowd[1:])


async def test_limits_and_finish_reasons(tiny_target):
    async with running(make_config(tiny_target, max_model_len=64)) as engine:
        deltas = await engine.generate(
            [1, 2, 3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        )
        assert len(token_ids(deltas)) == 5
        assert deltas[-1].finish_reason is FinishReason.LENGTH
        assert deltas[-1].usage.completion_tokens == 5
        with pytest.raises(InvalidRequest, match="context length"):
            engine.submit([1] * 60, SamplingParams(max_tokens=10))
        with pytest.raises(InvalidRequest, match="outside the vocabulary"):
            engine.submit([1, 10**6], SamplingParams())
        with pytest.raises(InvalidRequest, match="empty"):
            engine.submit([], SamplingParams())


async def test_stop_token_ends_request(tiny_target):
    async with running(make_config(tiny_target)) as engine:
        free_run = token_ids(await engine.generate([4, 5], GREEDY))
        stop = free_run[6]
        params = SamplingParams(
            max_tokens=24, temperature=0, stop_token_ids=(stop,), ignore_eos=True
        )
        deltas = await engine.generate([4, 5], params)
    out = token_ids(deltas)
    assert out == free_run[: free_run.index(stop) + 1]
    assert deltas[-1].finish_reason is FinishReason.STOP


async def test_random_submits_and_aborts_free_every_page(tiny_target):
    rng = random.Random(7)
    async with running(make_config(tiny_target, pages=64, page_size=4)) as engine:
        streams = []
        for i in range(200):
            action = rng.random()
            if action < 0.6 or not streams:
                prompt = [rng.randrange(1, 300) for _ in range(rng.randint(1, 20))]
                params = SamplingParams(max_tokens=rng.randint(1, 12), temperature=rng.random())
                streams.append(engine.submit(prompt, params, request_id=f"r{i}"))
            else:
                engine.abort(rng.choice(streams).request_id)
            await asyncio.sleep(rng.random() * 0.004)
        ends = [[d async for d in s] for s in streams]
        assert all(e and e[-1].finish_reason is not None for e in ends)
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages
        assert not engine.outputs and not engine.scheduler.running
    assert all(t.done() for t in engine._tasks) or not engine._tasks


async def test_failing_stage_errors_its_requests_and_engine_goes_on(tiny_target):
    def fault(stage, plan, dev):
        if stage == "verify" and plan.step == 3:
            raise RuntimeError("injected")

    async with running(make_config(tiny_target, fault=fault)) as engine:
        first = await engine.generate([1, 2, 3], GREEDY)
        assert first[-1].finish_reason is FinishReason.ERROR
        assert "injected" in first[-1].error
        second = await engine.generate([1, 2, 3], GREEDY)
        assert second[-1].finish_reason is FinishReason.LENGTH
        await engine.wait_idle()
        assert engine.allocator.num_free == engine.allocator.num_pages


async def test_metrics_report_the_weights_and_kv_cache_held(tiny_target, tiny_draft):
    """The target's and the draft model's bytes: their prepared tensors, and their caches."""
    from models.linear import held_bytes

    async with running(make_config(tiny_target, "draft", tiny_draft)) as engine:
        draft = engine.drafter.model
        weights = held_bytes(engine.model) + held_bytes(draft)
        caches = [engine.stages.verifier.cache.data, engine.drafter.cache.data]
        value = engine.metrics.registry.value
        assert value("tandem_memory_bytes", kind="weights") == weights
        assert value("tandem_memory_bytes", kind="kv_cache") == sum(
            c.numel() * c.element_size() for c in caches
        )
