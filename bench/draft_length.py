"""The cost model's draft length against fixed ones, on the demo models.

python -m bench.draft_length [--method draft] [--repeats 5] [--new-tokens 64] [--batches 1 16]
    [--out FILE]

Output tokens/s of: no speculation; the drafter with the cost model choosing k per step in
0..k_max; the drafter with each fixed k (for MTP, k = 1 is the one-token mode, which never
waits for the host, and k > 1 the multi-token mode, which does once a step). Held-out
prompts, greedy and temperature 1, medians of interleaved repeats (bench/spec.py's loop);
each engine prints how many decode steps ran at each k.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from bench.spec import measure
from engine.config import EngineConfig, KVConfig, SpecConfig


def configs(method: str, k_max: int, fixed: list[int]) -> dict[str, EngineConfig]:
    kv = KVConfig(page_size=16, num_pages=4096)
    out = {"none": EngineConfig(kv=kv)}
    if k_max:
        spec = SpecConfig(method, num_speculative_tokens=k_max)
        out["adaptive"] = EngineConfig(kv=kv, spec=spec)
    for k in fixed:
        spec = SpecConfig(method, num_speculative_tokens=k, adaptive_k=False)
        out[f"k={k}"] = EngineConfig(kv=kv, spec=spec)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", default="draft", choices=("draft", "ngram", "eagle", "mtp"))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    parser.add_argument(
        "--k-max", type=int, default=6, help="the cost model's largest k (0: no cost model)"
    )
    parser.add_argument("--fixed", type=int, nargs="+", default=[1, 2, 3, 4, 6])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    table = asyncio.run(
        measure(
            configs(args.method, args.k_max, args.fixed),
            args.batches,
            args,
            tuple(args.temperatures),
        )
    )
    print("\n| batch | temperature | method | tokens/s | vs none | acceptance length |")
    print("|---|---|---|---|---|---|")
    for (name, batch, temp), row in sorted(table.items(), key=lambda x: (x[0][1], x[0][2])):
        base = table[("none", batch, temp)]["tokens_per_s"]
        print(
            f"| {batch} | {temp:g} | {name} | {row['tokens_per_s']:.1f} | "
            f"{row['tokens_per_s'] / base:.2f}x | {row['acceptance_length']:.2f} |"
        )
    if args.out:
        rows = [
            dict(zip(("method", "batch", "temperature"), key, strict=True), **row)
            for key, row in table.items()
        ]
        result = {"method": args.method, "k_max": args.k_max, "rows": rows}
        args.out.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
