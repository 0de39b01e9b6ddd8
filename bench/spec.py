"""Speculative decoding on the demo pair: speed with and without it, and acceptance.

python -m bench.spec [--repeats 5] [--new-tokens 128] [--out bench/results/spec.json]

On the held-out prompts (train/heldout_prompts.json), for each method and batch size 1, 4,
16, greedy and at temperature 1: output tokens per second (median of --repeats interleaved
repeats), mean acceptance length (tokens emitted per verify step), and the share of tokens
produced by speculative steps. Then, at batch 1 greedy, the acceptance length of the draft
model for k = 2..6.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from bench.common import heldout_prompts as prompts
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from engine.request import Delta, SamplingParams


@dataclass
class Run:
    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    rates: list[float] = field(default_factory=list)

    def add(self, outs: list[list[Delta]], seconds: float) -> None:
        usages = [out[-1].usage for out in outs if out and out[-1].usage]
        tokens = sum(u.completion_tokens for u in usages)
        self.tokens += tokens
        self.seconds += seconds
        self.rates.append(tokens / seconds)
        self.drafted += sum(u.draft_tokens for u in usages)
        self.accepted += sum(u.accepted_tokens for u in usages)
        self.spec_steps += sum(u.spec_steps for u in usages)

    def summary(self) -> dict:
        spec_tokens = self.accepted + self.spec_steps
        return {
            "tokens_per_s": statistics.median(self.rates),
            "acceptance_length": spec_tokens / self.spec_steps if self.spec_steps else 1.0,
            "spec_token_share": spec_tokens / self.tokens if self.tokens else 0.0,
        }


async def generate(engine: AsyncEngine, texts: list[str], params: SamplingParams) -> list:
    return await asyncio.gather(*(engine.generate(t, params) for t in texts))


async def measure(
    configs: dict[str, EngineConfig],
    batches: list[int],
    args,
    temperatures: tuple[float, ...] = (0.0, 1.0),
) -> dict:
    engines = {name: AsyncEngine(config) for name, config in configs.items()}
    for engine in engines.values():
        await engine.start()
    runs: dict[tuple, Run] = {}
    for repeat in range(args.repeats):
        for batch in batches:
            for temperature in temperatures:
                params = SamplingParams(
                    max_tokens=args.new_tokens,
                    temperature=temperature,
                    seed=repeat,
                    ignore_eos=True,
                )
                texts = prompts(64)[repeat * batch % 48 :][:batch]
                for name, engine in engines.items():
                    start = time.perf_counter()
                    outs = await generate(engine, texts, params)
                    key = (name, batch, temperature)
                    runs.setdefault(key, Run()).add(outs, time.perf_counter() - start)
                    print(f"repeat {repeat} {key}: {runs[key].rates[-1]:.1f} tok/s", flush=True)
    for name, engine in engines.items():
        steps = "tandem_spec_decode_steps_total"
        by_k = {k: int(engine.metrics.registry.value(steps, k=k)) for k in range(engine.k + 1)}
        print(f"{name}: decode steps by draft length {by_k}", flush=True)
        await engine.stop()
    return {key: run.summary() for key, run in runs.items()}


async def acceptance_by_k(base: EngineConfig, ks: list[int], new_tokens: int) -> dict[int, float]:
    result = {}
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    for k in ks:
        config = replace(base, spec=replace(base.spec, num_speculative_tokens=k))
        engine = AsyncEngine(config)
        await engine.start()
        run = Run()
        for text in prompts(16):
            start = time.perf_counter()
            run.add(await generate(engine, [text], params), time.perf_counter() - start)
        await engine.stop()
        result[k] = run.summary()["acceptance_length"]
        print(f"k={k}: acceptance length {result[k]:.2f}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument(
        "--ks",
        type=int,
        nargs="*",
        default=[2, 3, 4, 5, 6],
        help="draft lengths whose acceptance length is measured (none: skip)",
    )
    parser.add_argument(
        "--argmax-drafts", action="store_true", help="also the draft model drafting its argmax"
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    kv = KVConfig(page_size=16, num_pages=4096)
    configs = {
        method: EngineConfig(kv=kv, spec=SpecConfig(method=method, num_speculative_tokens=args.k))
        for method in ("none", "draft", "ngram")
    }
    if args.argmax_drafts:
        spec = SpecConfig("draft", num_speculative_tokens=args.k, sampled_drafts=False)
        configs["draft-argmax"] = EngineConfig(kv=kv, spec=spec)
    table = asyncio.run(measure(configs, args.batches, args))
    by_k = asyncio.run(acceptance_by_k(configs["draft"], args.ks, args.new_tokens))
    print(
        "\n| method | batch | temperature | tokens/s | speedup | acceptance length "
        "| spec share |\n|---|---|---|---|---|---|---|"
    )
    for (method, batch, temp), row in sorted(table.items(), key=lambda x: (x[0][2], x[0][1])):
        base = table[("none", batch, temp)]["tokens_per_s"]
        print(
            f"| {method} (k={args.k}) | {batch} | {temp:g} | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / base:.2f}x | {row['acceptance_length']:.2f} | "
            f"{row['spec_token_share']:.0%} |"
        )
    if by_k:
        print("\n| k | " + " | ".join(map(str, by_k)) + " |")
        print("|---" * (len(by_k) + 1) + "|")
        print("| acceptance length | " + " | ".join(f"{v:.2f}" for v in by_k.values()) + " |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        rows = [
            dict(zip(("method", "batch", "temperature"), key, strict=True), **row)
            for key, row in table.items()
        ]
        args.out.write_text(
            json.dumps({"k": args.k, "rows": rows, "acceptance_by_k": by_k}, indent=2)
        )


if __name__ == "__main__":
    main()
