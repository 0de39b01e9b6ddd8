"""Where a decode step's time goes beside the forwards bench.speed times alone.

    python -m bench.overhead [--methods M ...] [--batch 1] [--temperature 0] [--repeats 5]
            [--max-tokens 128] [--k 4] [--model DIR] [--draft-model DIR]
        [--out bench/results/overhead.json]

bench.speed's efficiency is (the step's forwards timed alone) / (the step's time); this splits
the rest, the per-step overhead, into three measured parts:

    step - forwards alone = (forwards in the engine - forwards alone)
                          + host work inside the stages + time between the stages

"Forwards in the engine" is the wall time inside the target's and the drafter's module
forwards and their LM-head products during the decode steps bench.speed times (forward hooks
on those modules; a hook costs a few microseconds); "forwards alone" are bench.speed's, run
back to back in the step's order. They run slower in the engine when the event loop's thread
takes a core (or the GIL) from the compute thread's parallel work. "Host work inside the
stages" is the rest of the stages' time on the compute thread: attention metadata, sampling
and verification, the drafters' bookkeeping. "Between the stages" is the step's time outside
every stage: mostly the wait, after the sample stage, while the event loop (woken by the
sampled tokens) publishes them and plans the next step, holding the GIL and a core. Per stage
the table also shows its time and, in parentheses, its forwards.

The cells run as bench.speed's (its runners, configurations and forwards timed alone), one
request per batch slot, repeats interleaved over the methods; values are means per step over
all the repeats (means, so that the parts add up; bench.speed reports medians).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from bench import speed
from bench.common import heldout_prompts
from bench.runners import ENGINE_METHODS, EngineRunner, MethodUnavailable, decode_step_ids
from models.tokenizer import Tokenizer

STAGES = ("upload", "draft", "verify", "sample", "refill")  # a step's compute-thread stages


class ForwardClock:
    """Wall-clock intervals inside the given modules' forwards (outermost calls only), kept
    while `recording` is set. The hooks run on the thread that runs the forwards."""

    def __init__(self, modules: Iterable[torch.nn.Module]):
        self.recording = False
        self.intervals: list[tuple[float, float]] = []
        self._depth = 0
        self._start = 0.0
        for module in {id(m): m for m in modules}.values():
            module.register_forward_pre_hook(self._enter)
            module.register_forward_hook(self._exit)

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            self._start = time.perf_counter()
        self._depth += 1

    def _exit(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0 and self.recording:
            self.intervals.append((self._start, time.perf_counter()))


def forward_modules(runner: EngineRunner) -> list[torch.nn.Module]:
    """The modules whose forwards count as a step's forwards: the target, the drafter's model
    or head, and the LM heads that turn their hidden states into logits."""
    modules: list[torch.nn.Module] = [runner.engine.model, runner.engine.model.lm_head]
    if runner.draft_module is not None:
        modules.append(runner.draft_module)
        lm_head = getattr(runner.draft_module, "lm_head", None)  # a draft model's own
        if isinstance(lm_head, torch.nn.Module):
            modules.append(lm_head)
    return modules


def split_steps(
    records: list[dict], intervals: list[tuple[float, float]], batch: int
) -> dict[str, float]:
    """Mean seconds per decode step (the steps bench.speed times): the step, its forwards,
    each stage and the forwards inside it, and the time between the stages."""
    spans = {
        (r["step"], r["stage"]): (r["start"], r["end"]) for r in records if r["stage"] in STAGES
    }
    steps = decode_step_ids(records, batch)
    totals = dict.fromkeys(["step", "between", "in_forwards"], 0.0)
    for stage in STAGES:
        totals[stage] = totals[f"{stage}_forwards"] = 0.0
    for s in steps:
        period = spans[(s, "refill")][1] - spans[(s - 1, "refill")][1]
        totals["step"] += period
        busy = 0.0
        for stage in STAGES:
            start, end = spans.get((s, stage), (0.0, 0.0))
            inside = sum(b - a for a, b in intervals if start <= a and b <= end)
            totals[stage] += end - start
            totals[f"{stage}_forwards"] += inside
            totals["in_forwards"] += inside
            busy += end - start
        totals["between"] += period - busy
    return {name: value / len(steps) for name, value in totals.items()} if steps else {}


def row(name: str, splits: list[dict[str, float]], alone: list[float]) -> dict[str, Any]:
    """One method's means (ms) over the repeats; alone: each repeat's forwards timed alone.
    Means, so that the parts add up: step - alone = slower + host + between."""
    mean = lambda values: statistics.fmean(values) * 1e3  # noqa: E731
    out: dict[str, Any] = {"method": name}
    out["step_ms"] = mean(s["step"] for s in splits)
    out["alone_ms"] = mean(alone)
    out["in_engine_ms"] = mean(s["in_forwards"] for s in splits)
    out["slower_ms"] = out["in_engine_ms"] - out["alone_ms"]
    out["host_ms"] = mean(sum(s[st] - s[f"{st}_forwards"] for st in STAGES) for s in splits)
    out["between_ms"] = mean(s["between"] for s in splits)
    out["efficiency"] = out["alone_ms"] / out["step_ms"]
    out["stages_ms"] = {
        st: [mean(s[st] for s in splits), mean(s[f"{st}_forwards"] for s in splits)]
        for st in STAGES
    }
    return out


COLUMNS = (
    ("method", "method", "{}"),
    ("step ms", "step_ms", "{:.1f}"),
    ("forwards alone ms", "alone_ms", "{:.1f}"),
    ("forwards in engine ms", "in_engine_ms", "{:.1f}"),
    ("slower in engine ms", "slower_ms", "{:.1f}"),
    ("host in stages ms", "host_ms", "{:.1f}"),
    ("between stages ms", "between_ms", "{:.1f}"),
    ("efficiency", "efficiency", "{:.2f}"),
)


def markdown(rows: list[dict[str, Any]]) -> str:
    stage_head = " / ".join(STAGES)
    lines = [
        "| " + " | ".join(c[0] for c in COLUMNS) + f" | {stage_head} ms (forwards) |",
        "|" + "---|" * (len(COLUMNS) + 1),
    ]
    for r in rows:
        cells = [fmt.format(r[key]) for _, key, fmt in COLUMNS]
        stages = " / ".join(
            f"{t:.1f}" + (f" ({f:.1f})" if f > 0 else "") for t, f in r["stages_ms"].values()
        )
        lines.append("| " + " | ".join(cells) + f" | {stages} |")
    return "\n".join(lines)


async def measure(
    runners: dict[Any, EngineRunner], groups: list[list[list[int]]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    clocks = {m: ForwardClock(forward_modules(r)) for m, r in runners.items()}
    splits: dict[Any, list[dict[str, float]]] = {m: [] for m in runners}
    alone: dict[Any, list[float]] = {m: [] for m in runners}
    for runner in runners.values():
        await runner.start()
        await runner.run(groups[:1], 0.0, 0, min(8, args.max_tokens))  # warm-up, untimed
    for repeat in range(args.repeats):
        for method, runner in runners.items():
            clock = clocks[method]
            clock.intervals.clear()
            clock.recording = True
            sample = await runner.run(groups, args.temperature, 1000 * repeat, args.max_tokens)
            clock.recording = False  # the forwards timed alone ran after the cell
            records = list(runner.engine.tracer.records or [])
            split = split_steps(records, clock.intervals, args.batch)
            if split:
                splits[method].append(split)
                alone[method].append(sample.forwards_s)
        print(f"repeat {repeat + 1}/{args.repeats} done", file=sys.stderr)
    for runner in runners.values():
        await runner.stop()
    return [row(m.name, splits[m], alone[m]) for m in runners if splits[m]]


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.overhead", description=__doc__.split("\n")[0])
    p.add_argument("--methods", nargs="+", choices=ENGINE_METHODS, default=list(ENGINE_METHODS))
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=5, help="interleaved (median)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--k", type=int, default=4, help="draft tokens a step (mtp-1: 1)")
    p.add_argument("--model", help="target directory (default: the demo's)")
    p.add_argument("--draft-model", help="draft model directory (default: the demo's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the cores here)")
    p.add_argument("--out", type=Path, default=Path("bench/results/overhead.json"))
    args = p.parse_args(argv)
    if args.batch < 1 or args.repeats < 1 or args.max_tokens < 2:
        p.error("--batch and --repeats must be at least 1, --max-tokens at least 2")
    return args


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    settings = speed.parse_args(
        ["--methods", *args.methods, "--batches", str(args.batch), "--temperatures",
         str(args.temperature), "--repeats", str(args.repeats),
         "--max-tokens", str(args.max_tokens), "--prompts", str(args.batch), "--k", str(args.k),
         "--k-mode", "fixed"]
        + [f"--{name}={value}" for name, value in (("model", args.model),
           ("draft-model", args.draft_model)) if value],
        min_repeats=1,
    )  # fmt: skip
    tokenizer = Tokenizer(speed.target_dir(settings))
    prompts = [tokenizer.encode(text) for text in heldout_prompts(64)]
    max_len = max(map(len, prompts)) + args.max_tokens
    runners = speed.build_runners(speed.methods_from(settings), settings, max_len)
    groups = speed.request_groups(prompts, args.batch, args.batch)
    rows = asyncio.run(measure(runners, groups, args))  # type: ignore[arg-type]
    print(markdown(rows))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings_out = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
    result = {"settings": settings_out, "wall_s": time.perf_counter() - start, "rows": rows}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(parse_args(argv))
    except MethodUnavailable as error:
        print(f"bench.overhead: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
