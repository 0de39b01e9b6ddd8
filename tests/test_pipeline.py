"""The step timeline: plan N+1 overlaps step N's device work; the trace exports for Perfetto."""

from __future__ import annotations

import asyncio
import json

from core.params import SamplingParams
from engine.engine import AsyncEngine
from engine.trace import main
from tests.engine_util import make_config, ragged_prompts

DEVICE_STAGES = ("upload", "draft", "verify", "sample", "refill")


async def traced_run(config, prompts) -> list[dict]:
    engine = AsyncEngine(config)
    engine.tracer.keep(100_000)
    await engine.start()
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    await engine.stop()
    assert engine.tracer.records is not None
    return list(engine.tracer.records)


def overlapped_steps(records: list[dict]) -> int:
    """Steps N whose device work was still running when plan N+1 started."""
    plan_start = {r["step"]: r["start"] for r in records if r["stage"] == "plan"}
    device_end: dict[int, float] = {}
    for r in records:
        if r["stage"] in DEVICE_STAGES:
            device_end[r["step"]] = max(device_end.get(r["step"], 0.0), r["end"])
    return sum(
        1 for n, end in device_end.items() if n + 1 in plan_start and plan_start[n + 1] < end
    )


async def test_plan_overlaps_device_work(tiny_target, tiny_draft):
    prompts = ragged_prompts(8, 300)
    for method in ("none", "draft"):
        config = make_config(tiny_target, method, tiny_draft, device_delay=0.004)
        records = await traced_run(config, prompts)
        stages = {r["stage"] for r in records}
        assert stages == {"plan", *DEVICE_STAGES}
        decode_steps = {r["step"] for r in records if r.get("kind") == "decode"}
        assert overlapped_steps(records) >= len(decode_steps) // 2, method


async def test_not_pipelined_never_overlaps(tiny_target):
    config = make_config(tiny_target, pipelined=False, device_delay=0.002)
    records = await traced_run(config, ragged_prompts(4, 300))
    assert overlapped_steps(records) == 0


async def test_trace_file_exports_to_chrome_json(tiny_target, tmp_path):
    steps = tmp_path / "steps.jsonl"
    config = make_config(tiny_target, trace_file=str(steps))
    await traced_run(config, ragged_prompts(2, 300))
    out = tmp_path / "trace.json"
    assert main([str(steps), "-o", str(out)]) == 0
    trace = json.loads(out.read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert {e["name"] for e in spans} == {"plan", *DEVICE_STAGES}
    assert all(e["dur"] >= 0 and isinstance(e["args"]["step"], int) for e in spans)
