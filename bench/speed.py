"""Speed of every drafter against no speculation and against transformers, in one run.

    python -m bench.speed [--methods M ...] [--batches 1 4 16] [--temperatures 0 1]
        [--repeats 5] [--max-tokens 128] [--prompts 8] [--k 4] [--k-mode fixed|engine]
        [--seeded] [--eos] [--batch-invariant] [--out F.json]

On the held-out prompts, for each method, batch size and temperature: output tokens/s, time to
first token, inter-token latency p50/p99 (each token counted with its share of the wait), mean
acceptance length tau (tokens emitted per verify step), acceptance per draft position, the
share of tokens from speculative steps, and the ideal speedup, efficiency and per-step
overhead (defined in bench/report.py, measured as bench/runners.py says). Speeds are medians
over the repeats, which are interleaved: each repeat runs every method once, round-robin,
before the next repeat starts. At batch 1 the same prompts also run through transformers:
plain `generate`, assisted generation with the draft model (a constant `num_assistant_tokens`
= k) and prompt lookup. A cell's `prompts` requests run in groups of `batch` concurrent
requests (at least one group). `--k-mode engine` leaves k to the engine's cost model (mtp-1
and the trees keep theirs); `--seeded` gives requests seeds (sampled ones then draw by the
seeded coupling); `--eos` ends a request at its end of sequence (by default every request
decodes --max-tokens).

This module owns the command line, the methods' configurations and the measuring loop; the
runners live in bench/runners.py and the rows, aims and the table in bench/report.py.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from bench.common import PAGE_SIZE, heldout_prompts, request_groups, write_json
from bench.report import aim_line, aims, build_rows, markdown_table
from bench.runners import (
    ENGINE_METHODS,
    HF_METHODS,
    EngineRunner,
    HFRunner,
    MethodUnavailable,
    Runner,
    Sample,
    eos_id,
    hf_models,
)
from engine.builder import DEMO_DIR, model_path
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.device import run_on_device
from models.tokenizer import Tokenizer
from train import chat_data

MIN_REPEATS = 5
# their k fixed: the cost model picks k for chains with the host in the loop only
PINNED_K = ("mtp-1", "eagle-fixed", "eagle-dynamic")


# ---- methods -> configurations ----


def spec_config(method: str, args: argparse.Namespace) -> SpecConfig:
    """The speculative configuration of an engine method; MethodUnavailable if not built."""
    base, _, variant = method.partition("-")
    if base == "none":
        return SpecConfig("none")
    fields: dict[str, Any] = {"method": base, "num_speculative_tokens": args.k}
    directories = {"draft": args.draft_model, "eagle": args.eagle_head, "mtp": args.mtp_head}
    fields["draft"] = directories.get(base)
    if method == "mtp-1":
        fields["num_speculative_tokens"] = 1
    if base == "eagle":
        fields["tree"] = variant
    if args.k_mode == "fixed" or method in PINNED_K:
        fields["adaptive_k"] = False
    try:
        return SpecConfig(**fields)
    except (TypeError, ValueError) as error:
        raise MethodUnavailable(f"{method}: {error}") from error


def target_dir(args: argparse.Namespace) -> Path:
    return model_path(args.model)


def build_runners(args: argparse.Namespace, max_len: int) -> dict[str, Runner]:
    """Every method's runner, built before anything is timed: a method that cannot run stops
    the benchmark here, with its reason (configurations first, as they fail fastest)."""
    pages = max(args.batches) * -(-(max_len + 2 * args.k + 8) // PAGE_SIZE) * 2
    kv = KVConfig(page_size=PAGE_SIZE, num_pages=pages)
    batch, invariant = max(args.batches), args.batch_invariant
    base = EngineConfig(args.model, kv=kv, max_running=batch, batch_invariant=invariant)
    engine_methods = [m for m in args.methods if m not in HF_METHODS]
    configs = {m: replace(base, spec=spec_config(m, args)) for m in engine_methods}
    runners: dict[str, Runner] = {
        m: EngineRunner(m, c, args.seeded, args.eos) for m, c in configs.items()
    }
    hf_methods = [m for m in args.methods if m in HF_METHODS]
    if hf_methods:
        target, draft = target_dir(args), Path(args.draft_model or DEMO_DIR / "draft")
        cpu = torch.device("cpu")  # loaded on the thread that runs them (engine/device.py)
        target_model, assistant = run_on_device(cpu, hf_models, target, draft, args.k)
        for m in hf_methods:
            runners[m] = HFRunner(m, target_model, assistant, args.k, eos_id(target), args.eos)
    return {m: runners[m] for m in args.methods}  # in the order asked for


# ---- the measuring loop ----


async def measure(
    runners: dict[str, Runner], prompts: list[list[int]], args: argparse.Namespace
) -> dict[tuple, list[Sample]]:
    """Samples per (method, batch, temperature), repeats interleaved over the methods."""
    cells = [
        (m, b, t)
        for b in args.batches
        for t in args.temperatures
        for m in runners
        if m not in HF_METHODS or b == 1
    ]
    groups = {b: request_groups(prompts, b, args.prompts) for b in args.batches}
    for runner in runners.values():
        await runner.start()
        for b in [1] if runner.method in HF_METHODS else args.batches:  # warm-up, untimed
            await runner.run(groups[b][:1], 0.0, 0, min(8, args.max_tokens))
    samples: dict[tuple, list[Sample]] = {cell: [] for cell in cells}
    with tqdm(total=len(cells) * args.repeats, desc="bench.speed", unit="cell") as bar:
        for repeat in range(args.repeats):
            for method, batch, temp in cells:
                sample = await runners[method].run(
                    groups[batch], temp, 1000 * repeat, args.max_tokens
                )
                samples[(method, batch, temp)].append(sample)
                bar.set_postfix_str(f"{method} b{batch} t{temp:g}")
                bar.update()
    for runner in runners.values():
        await runner.stop()
    return samples


# ---- command line ----


def parse_args(
    argv: Sequence[str] | None = None, min_repeats: int = MIN_REPEATS
) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.speed", description=__doc__.split("\n")[0])
    every = (*ENGINE_METHODS, *HF_METHODS)
    p.add_argument("--methods", nargs="+", choices=every, default=list(every))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--batch-invariant", action="store_true", help="the engine's mode of that name")
    p.add_argument("--seeded", action="store_true", help="requests carry seeds (the coupling)")
    p.add_argument("--eos", action="store_true", help="requests end at their end of sequence")
    p.add_argument("--repeats", type=int, default=MIN_REPEATS, help="interleaved (median)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompts", type=int, default=8, help="requests per cell (>= one batch)")
    p.add_argument("--k", type=int, default=4, help="draft tokens a step (mtp-1: 1)")
    p.add_argument("--k-mode", choices=("fixed", "engine"), default="fixed")
    p.add_argument("--model", default="demo", help="target: demo, smollm2, a directory or a GGUF")
    p.add_argument("--chat", action="store_true", help="the held-out chat prompts, as chats")
    p.add_argument("--draft-model", help="draft model directory (default: the demo's)")
    p.add_argument("--eagle-head", help="EAGLE head directory (default: the demo's)")
    p.add_argument("--mtp-head", help="MTP head directory (default: the demo's)")
    p.add_argument("--threads", type=int, default=2, help="torch threads (the cores here)")
    p.add_argument("--out", type=Path, help="the JSON report")
    args = p.parse_args(argv)
    if args.repeats < min_repeats:
        p.error(f"--repeats must be at least {min_repeats}")
    if any(m in HF_METHODS for m in args.methods) and 1 not in args.batches:
        p.error("the transformers methods run at batch 1 only: include 1 in --batches")
    if min(args.batches) < 1 or args.max_tokens < 2 or args.prompts < 1:
        p.error("--batches and --prompts must be at least 1, --max-tokens at least 2")
    return args


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The whole benchmark; prints the table and the aims, writes the JSON; returns the rows."""
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    tokenizer = Tokenizer(target_dir(args))
    if args.chat:
        chats = chat_data.load_prompts(chat_data.HELDOUT_PROMPTS)
        prompts = [chat_data.chat_ids(tokenizer, text) for text in chats]
    else:
        prompts = [tokenizer.encode(text) for text in heldout_prompts(64)]
    runners = build_runners(args, max(map(len, prompts)) + args.max_tokens)
    rows = build_rows(asyncio.run(measure(runners, prompts, args)))
    goals = aims(rows)
    print(markdown_table(rows))
    for g in goals:
        print(aim_line(g))
    wall = time.perf_counter() - start
    document = {"settings": vars(args), "threads": torch.get_num_threads(), "wall_s": wall}
    if args.out:
        write_json(args.out, document | {"rows": rows, "aims": goals})
    print(f"wrote {args.out or 'nothing'} in {wall:.0f} s")
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except MethodUnavailable as error:
        print(f"bench.speed: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
