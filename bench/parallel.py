"""What tensor parallelism costs a step: one process against N ranks (gloo), in one run.

    python -m bench.parallel [--methods none draft mtp] [--batches 1 16] [--size 2]
        [--max-tokens 64] [--repeats 3] [--out bench/results/parallel.json]

On the demo family, greedy, each batch of held-out prompts runs through one process and then
through `--size` ranks. Printed per row: output tokens/s, the mean step time (wall time over
decode and prefill steps), and per step the bytes the leader sent through each collective
(the step's broadcast, the all-reduces of o, down and the heads' input projections and of the
vocabulary-split embedding, the logits' all-gathers). On 2 cores the point is the overhead's
size, not speed: one process uses both cores for its products, each rank one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from typing import Any

from bench.common import heldout_prompts
from engine.builder import DEMO_DIR
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from engine.request import SamplingParams
from engine.trace import Tracer
from engine.worker import leave, start_leader
from models.parallel import traffic

HEADS = {"draft": "draft", "eagle": "eagle", "mtp": "mtp"}
COLLECTIVES = ("broadcast", "all_reduce", "all_gather")


def config(method: str, size: int, batch: int) -> EngineConfig:
    head = HEADS.get(method)
    spec = SpecConfig(
        method, str(DEMO_DIR / head) if head else None, num_speculative_tokens=4, adaptive_k=False
    )
    kv = KVConfig(num_pages=2048)
    return EngineConfig(spec=spec, kv=kv, max_running=batch, tensor_parallel_size=size)


async def measure(engine: AsyncEngine, prompts: list[str], max_tokens: int) -> dict[str, Any]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    engine.tracer = Tracer(keep=1 << 16)
    before = {name: getattr(traffic, name) for name in COLLECTIVES}
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
    wall = time.perf_counter() - start
    records = engine.tracer.records or []
    steps = len({r["step"] for r in records if r["stage"] == "verify"})
    tokens = sum(len(d.token_ids) for out in outs for d in out)
    row = {"tok_s": tokens / wall, "step_ms": 1e3 * wall / max(1, steps), "steps": steps}
    for name in COLLECTIVES:
        row[f"{name}_bytes_per_step"] = (getattr(traffic, name) - before[name]) / max(1, steps)
    return row


async def run_cell(method: str, size: int, batch: int, args: argparse.Namespace) -> dict:
    cfg = config(method, size, batch)
    workers = None
    if size > 1:
        engine, workers = start_leader(cfg)
    else:
        engine = AsyncEngine(cfg)
    prompts = (heldout_prompts(batch) * batch)[:batch]
    try:
        await engine.start()
        await measure(engine, prompts[:1], 8)  # warm-up
        rows = [await measure(engine, prompts, args.max_tokens) for _ in range(args.repeats)]
        await engine.stop()
    finally:
        if workers is not None:
            leave(workers)
    best = {key: statistics.median(r[key] for r in rows) for key in rows[0]}
    return {"method": method, "ranks": size, "batch": batch, **best}


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.parallel", description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", default=["none", "draft", "mtp"])
    p.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    p.add_argument("--size", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    rows = []
    for method in args.methods:
        for batch in args.batches:
            for size in (1, args.size):
                row = asyncio.run(run_cell(method, size, batch, args))
                rows.append(row)
                print(json.dumps(row), flush=True)
    print("\n| method | batch | ranks | tok/s | step ms | broadcast B/step | all-reduce B/step "
          "| all-gather B/step |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(
            f"| {r['method']} | {r['batch']} | {r['ranks']} | {r['tok_s']:.1f} | "
            f"{r['step_ms']:.1f} | {r['broadcast_bytes_per_step']:.0f} | "
            f"{r['all_reduce_bytes_per_step']:.0f} | {r['all_gather_bytes_per_step']:.0f} |"
        )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
