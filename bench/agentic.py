"""Multi-turn chats, each turn resending the whole history: time to first token with and
without the prefix cache.

    python -m bench.agentic [--model smollm2] [--chats 3] [--turns 5] [--max-tokens 64]
        [--out bench/results/agentic.json]

A chat opens with a file to read (the first 4,000 characters of a module of Python's own
library, so that the requests are fixed by this script) and a question about it; each later
turn adds the model's answer, as text, and the next question (train/chat_heldout_prompts.json).
Histories reach 1-2k tokens on SmolLM2. Two engines serve the same chats, one with the
prefix cache and one without (no speculation, greedy, batch 1), taking each turn in turn, so
that the machine's drift falls on both alike. Per turn: prompt tokens, the tokens the cache
brought (`usage.prompt_tokens_details.cached_tokens`), and the time to first token of each
engine; at the end the median ratio over the second and later turns.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from engine.config import EngineConfig, KVConfig
from engine.engine import AsyncEngine
from engine.request import SamplingParams

QUESTIONS = Path(__file__).resolve().parent.parent / "train" / "chat_heldout_prompts.json"
MODULES = ("textwrap", "json.decoder", "fractions", "shlex", "heapq", "bisect")
FILE_CHARS = 4000


def chat_openings(n: int) -> list[str]:
    """n first turns: a file of Python's library, and a question about it."""
    openings = []
    for name in MODULES[:n]:
        source = inspect.getsource(importlib.import_module(name))[:FILE_CHARS]
        openings.append(f"Here is a file, {name}:\n\n{source}\n\nWhat does this code do?")
    return openings


def questions() -> list[str]:
    return json.loads(QUESTIONS.read_text())


async def first_token(engine: AsyncEngine, prompt: list[int], max_tokens: int):
    """(seconds to the first token, the answer's text, the prompt tokens the cache brought)."""
    start = time.perf_counter()
    ttft, text, cached = None, "", 0
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    async for delta in engine.submit(prompt, params):
        if ttft is None and delta.token_ids:
            ttft = time.perf_counter() - start
        text += delta.text
        cached = delta.usage.cached_tokens if delta.usage else cached
    assert ttft is not None
    return ttft, text, cached


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    engines = {}
    for cache in (True, False):
        kv = KVConfig(num_pages=args.num_pages, prefix_cache=cache)
        engine = AsyncEngine(EngineConfig(args.model, kv=kv, max_running=1))
        await engine.start()
        engines[cache] = engine
    rows = []
    try:
        asked = iter(questions())
        for chat, opening in enumerate(chat_openings(args.chats)):
            messages = [{"role": "user", "content": opening}]
            for turn in range(args.turns):
                prompt = engines[True].tokenizer.encode_chat(messages)
                row: dict[str, Any] = {"chat": chat, "turn": turn, "prompt_tokens": len(prompt)}
                answers = {}
                for cache, engine in engines.items():
                    ttft, answers[cache], cached = await first_token(
                        engine, prompt, args.max_tokens
                    )
                    row["ttft_cached" if cache else "ttft_plain"] = round(ttft, 4)
                    if cache:
                        row["cached_tokens"] = cached
                row["same_answer"] = answers[True] == answers[False]
                print(json.dumps(row), flush=True)
                rows.append(row)
                messages += [
                    {"role": "assistant", "content": answers[False]},
                    {"role": "user", "content": next(asked)},
                ]
    finally:
        for engine in engines.values():
            await engine.stop()
    return rows


def summary(rows: list[dict[str, Any]]) -> str:
    later = [r for r in rows if r["turn"] > 0]
    speedup = statistics.median(r["ttft_plain"] / r["ttft_cached"] for r in later)
    hit = sum(r["cached_tokens"] for r in later) / sum(r["prompt_tokens"] for r in later)
    return (
        f"turns 2+: time to first token {speedup:.1f}x lower with the prefix cache (median of "
        f"{len(later)}); {100 * hit:.0f}% of their prompt tokens came from the cache"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.agentic", description=__doc__)
    parser.add_argument("--model", default="smollm2", help="smollm2, a path, or demo")
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--num-pages", type=int, default=512, help="KV pages of each engine")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    args = parser.parse_args(argv)
    args.model = None if args.model == "demo" else args.model
    rows = asyncio.run(run(args))
    print(summary(rows))
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
