"""What the pipelined step buys: plan CPU time, and how much of it hides behind device work.

python -m bench.pipeline [--requests 16] [--delay 0.004] [--out results.json]

Runs plain greedy decoding on a small random model (written to a temporary directory) with
the step timeline kept in memory, then reports
- the plan stage's CPU time per step and per request (microseconds),
- the share of plan time during which the device was busy (with earlier steps' work),
- the mean step time with pipelining on and off, with the device made slow by the delay mode
  (each piece of device work sleeps up to --delay seconds first), medians of --repeats runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from engine.config import EngineConfig, KVConfig
from engine.engine import AsyncEngine
from engine.request import SamplingParams
from engine.trace import Tracer
from tests.tiny import write_model

DEVICE = ("upload", "draft", "verify", "sample", "refill")


async def run(model: Path, requests: int, delay: float, pipelined: bool) -> dict:
    config = EngineConfig(
        model=str(model),
        kv=KVConfig(page_size=16, num_pages=1024),
        device_delay=delay,
        pipelined=pipelined,
    )
    engine = AsyncEngine(config)
    engine.tracer = Tracer(keep=1_000_000)
    await engine.start()
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    prompts = [[(7 * i + j) % 300 + 1 for j in range(32)] for i in range(requests)]
    start = time.perf_counter()
    await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    wall = time.perf_counter() - start
    await engine.stop()
    return summarize(list(engine.tracer.records or []), wall)


def summarize(records: list[dict], wall: float) -> dict:
    plans = [r for r in records if r["stage"] == "plan" and r["kind"] == "decode"]
    busy = _union([(r["start"], r["end"]) for r in records if r["stage"] in DEVICE])
    plan_time = sum(p["end"] - p["start"] for p in plans)
    hidden = sum(_overlap((p["start"], p["end"]), busy) for p in plans)
    steps = len({r["step"] for r in records})
    return {
        "steps": steps,
        "step_ms": wall / steps * 1e3,
        "plan_us_per_request": statistics.median(
            (p["end"] - p["start"]) / p["batch_size"] * 1e6 for p in plans
        ),
        "plan_us_per_step": plan_time / len(plans) * 1e6,
        "plan_hidden_share": hidden / plan_time,
    }


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Sorted, disjoint intervals covering the spans: when the device was busy."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _overlap(span: tuple[float, float], busy: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(span[1], hi) - max(span[0], lo)) for lo, hi in busy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--delay", type=float, default=0.004)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = write_model(Path(tmp), layers=4, hidden=256, scale=0.5)
        rows: dict[str, list[dict]] = {"on": [], "off": []}
        for _ in range(args.repeats):  # interleaved, so drift hits both alike
            for mode in rows:
                rows[mode].append(asyncio.run(run(model, args.requests, args.delay, mode == "on")))
    result = {
        mode: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
        for mode, runs in rows.items()
    }
    print(f"{'pipelining':<11}{'step ms':>9}{'plan us/req':>13}{'plan us/step':>14}{'hidden':>8}")
    for mode, r in result.items():
        print(
            f"{mode:<11}{r['step_ms']:>9.2f}{r['plan_us_per_request']:>13.1f}"
            f"{r['plan_us_per_step']:>14.1f}{r['plan_hidden_share']:>8.0%}"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
