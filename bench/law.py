"""The sampled law of every drafter on a real model (SmolLM2 by default), outside CI: N
continuations of a few tokens of one held-out chat prompt at temperature 1 and top-k 20
(so that the law has few outcomes), drawn through the engine with speculation, against the
law enumerated from the target itself. Pearson's test from tests/stats.py (outcomes expected
fewer than 5 times pooled), and its power: the same draws against the law with 4% of the
likeliest first token's mass moved elsewhere must be rejected.

    python -m bench.law --model smollm2 --out bench/results/law-smollm2.json
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.common import text_table, write_json
from core.params import SamplingParams
from engine.builder import DEMO_DIR, model_path
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.device import run_on_device
from engine.engine import AsyncEngine
from models.loader import load_model
from models.tokenizer import Tokenizer
from tests.stats import POWER_SHIFT, chi_square_p_value, enumerate_law, shifted_law
from train import chat_data

SMOLLM2_EAGLE1 = DEMO_DIR.parent / "smollm2" / "eagle1"

# name -> the speculative configuration (k = 4, fixed: the cost model could stop drafting)
METHODS: dict[str, dict[str, Any]] = {
    "none": {"method": "none"},
    "ngram": {"method": "ngram"},
    "eagle3-chain": {"method": "eagle"},
    "eagle3-fixed": {"method": "eagle", "tree": "fixed"},
    "eagle3-dynamic": {"method": "eagle", "tree": "dynamic"},
    "eagle1-chain": {"method": "eagle", "draft": str(SMOLLM2_EAGLE1)},
    "mtp-k": {"method": "mtp"},
    "mtp-1": {"method": "mtp", "num_speculative_tokens": 1},
}


def spec(name: str) -> SpecConfig:
    return SpecConfig(**{"num_speculative_tokens": 4, "adaptive_k": False} | METHODS[name])


async def draw(config: EngineConfig, prompt: list[int], params: SamplingParams, n: int):
    """n continuations through the engine: their counts, and the share of drafts kept."""
    engine = AsyncEngine(config)
    await engine.start()
    try:
        outs = await asyncio.gather(*(engine.generate(prompt, params) for _ in range(n)))
    finally:
        await engine.stop()
    counts = collections.Counter(tuple(t for d in out for t in d.token_ids) for out in outs)
    usages = [out[-1].usage for out in outs]  # on every stream's last delta
    drafted = sum(u.draft_tokens for u in usages if u)
    accepted = sum(u.accepted_tokens for u in usages if u)
    kept = accepted / drafted if drafted else None
    return counts, kept


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    path = model_path(args.model)
    tokenizer = Tokenizer(path)
    chats = chat_data.load_prompts(chat_data.HELDOUT_PROMPTS)
    prompt = chat_data.chat_ids(tokenizer, chats[args.prompt])
    params = SamplingParams(
        temperature=1.0, top_k=args.top_k, max_tokens=args.tokens, ignore_eos=True
    )
    start = time.perf_counter()
    cpu = torch.device("cpu")  # the one compute thread (engine/device.py)
    model = run_on_device(cpu, load_model, path)
    law = run_on_device(cpu, enumerate_law, model, prompt, params, args.tokens)
    vocab = model.config.vocab_size
    del model
    seconds = time.perf_counter() - start
    print(
        f"a prompt of {len(prompt)} tokens; its exact law: {len(law)} outcomes in {seconds:.0f} s"
    )
    kv = KVConfig(page_size=16, num_pages=args.batch * (-(-(len(prompt) + 16) // 16) + 2) * 2)
    rows = []
    for seed, name in enumerate(args.methods):  # a seed each: independent draws
        config = EngineConfig(
            args.model, spec(name), kv, max_running=args.batch, max_waiting=args.n, seed=seed
        )
        start = time.perf_counter()
        counts, kept = asyncio.run(draw(config, prompt, params, args.n))
        p = chi_square_p_value(counts, law, args.n)
        power = chi_square_p_value(counts, shifted_law(law, POWER_SHIFT, vocab), args.n)
        rows.append(
            {
                "method": name,
                "n": args.n,
                "tokens": args.tokens,
                "top_k": args.top_k,
                "p_value": p,
                "p_value_shifted": power,
                "drafts_kept": kept,
                "distinct": len(counts),
                "seconds": time.perf_counter() - start,
            }
        )
        print(f"{name}: p = {p:.3g}, against a {POWER_SHIFT:.0%} shift p = {power:.2g}")
    return rows


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.law", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2", help="smollm2, a directory or a GGUF")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--n", type=int, default=2000, help="continuations a method")
    p.add_argument("--tokens", type=int, default=3, help="tokens a continuation")
    p.add_argument("--top-k", type=int, default=20)
    p.add_argument("--prompt", type=int, default=0, help="which held-out chat prompt")
    p.add_argument("--batch", type=int, default=64, help="requests running at once")
    p.add_argument("--out", type=Path, help="write the rows here (JSON)")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    rows = run(args)
    cells = [
        [r["method"], f"{r['p_value']:.3g}", f"{r['p_value_shifted']:.2g}",
         "-" if r["drafts_kept"] is None else f"{r['drafts_kept']:.2f}", str(r["distinct"]),
         f"{r['seconds']:.0f}"]
        for r in rows
    ]  # fmt: skip
    header = ["method", "p (exact law)", f"p ({POWER_SHIFT:.0%} shift)", "drafts kept",
              "distinct", "s"]  # fmt: skip
    print(text_table(header, cells))
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
