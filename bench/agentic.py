"""Agentic workloads on SmolLM2: multi-turn chats with and without the prefix cache, the same
turns per drafter, and code edits and tool-result echoes whose answers repeat the prompt.

    python -m bench.agentic [--workload chats] [--chats 3] [--turns 5] [--max-tokens 64]
    python -m bench.agentic --workload turns [--methods none ngram suffix eagle hybrid]
        [--no-prefix-cache]
    python -m bench.agentic --workload edits|echo [--methods none ngram suffix] [--rounds 1]
        [--k 4] [--weights W] [--fixed-k] [--llama-server PATH]

Chats: a chat opens with a file to read (the first 4,000 characters of a module of Python's
library, so that the requests are fixed by this script) and a question about it; each later
turn adds the model's answer, as text, and the next question (train/chat_heldout_prompts.json).
Two engines serve the same chats, with the prefix cache and without (no speculation, greedy,
batch 1), taking each turn in turn. Per turn: prompt tokens, the tokens the cache brought and
each engine's time to first token; at the end the median ratio over the later turns.

Turns: the chats' turns, each its whole history answered first by plain decoding, so that
every method serves the same requests, run as the edits are: per method also the mean time to
first token.

Edits: six functions of Python's library (49-102 lines), each to be answered whole with one
variable renamed; echo: six tool results (a JSON list of eight records, drawn with a fixed
seed) to be repeated with one record's status changed. Greedy, batch 1, up to 768 tokens, eos
honoured; each method's engine in a process of its own (bench/common.py EngineProcess), the
methods taking each task in turn. Per method: decode tokens/s after the first token, its ratio
to no speculation, tokens per speculative step, and the share of the answers' tokens inside a
run of 8 found in the prompt (what the model copied). With --llama-server the tasks go through
llama.cpp's server instead (the same GGUF and prompt ids, its prompt cache on), once per
--spec-type (none, ngram-simple, ngram-mod, a draft capped at k), from its own timings.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import json
import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.code import EDITS
from bench.common import EngineProcess, answer, write_json
from core.params import SamplingParams
from engine.config import WEIGHTS, EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine

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


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0)


async def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    engines = {}
    for cache in (True, False):
        kv = KVConfig(num_pages=args.num_pages, prefix_cache=cache)
        engine = AsyncEngine(EngineConfig(args.model, SpecConfig("none"), kv, max_running=1))
        await engine.start()
        engines[cache] = engine
    rows = []
    try:
        asked = iter(questions())
        for chat, opening in enumerate(chat_openings(args.chats)):
            messages = user(opening)
            for turn in range(args.turns):
                prompt = engines[True].tokenizer.encode_chat(messages)
                row: dict[str, Any] = {"chat": chat, "turn": turn, "prompt_tokens": len(prompt)}
                answers = {}
                for cache, engine in engines.items():  # in turn: the machine's drift hits both
                    answers[cache] = await answer(engine, prompt, greedy(args.max_tokens))
                row["ttft_cached"] = round(answers[True].ttft, 4)
                row["ttft_plain"] = round(answers[False].ttft, 4)
                row["cached_tokens"] = answers[True].usage.cached_tokens
                row["same_answer"] = answers[True].text == answers[False].text
                print(json.dumps(row), flush=True)
                rows.append(row)
                answered = {"role": "assistant", "content": answers[False].text}
                messages += [answered, *user(next(asked))]
    finally:
        for engine in engines.values():
            await engine.stop()
    return rows


# ---- code edits ----

COPY_RUN = 8  # an answer token counts as copied inside a run of this many found in the prompt


def edit_prompts() -> list[str]:
    prompts = []
    for module, name, old, new in EDITS:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        source = inspect.getsource(target)
        assert old in source, (name, old)
        prompts.append(
            f"Rename the variable `{old}` to `{new}` in this Python function. Answer with the "
            f"whole function and nothing else.\n\n```python\n{source}```"
        )
    return prompts


def echo_prompts(n: int = 6) -> list[str]:
    """Tool results to hand back changed: a JSON list of records (fixed by a seeded draw), to
    be repeated with one field of one record changed."""
    rng = random.Random(7)
    names = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    cities = ["Lisbon", "Oslo", "Quito", "Hanoi", "Perth", "Accra", "Lima", "Riga"]
    prompts = []
    for task in range(n):
        records = [
            {"id": 100 * task + i, "name": rng.choice(names), "city": rng.choice(cities),
             "score": rng.randrange(1000), "status": "open"}
            for i in range(8)
        ]  # fmt: skip
        target = records[rng.randrange(8)]["id"]
        result = json.dumps({"results": records}, indent=1)
        prompts.append(
            f"A tool returned this JSON:\n\n```json\n{result}\n```\n\nRepeat the JSON "
            f'exactly, with the status of the record with id {target} set to "closed". '
            "Answer with the JSON only."
        )
    return prompts


async def edit(engine: AsyncEngine, messages: list[dict], max_tokens: int) -> dict[str, Any]:
    """One task (a chat's messages): decode tokens, seconds after the first token, seconds to
    it, speculative steps and accepted drafts, and the answer's copied tokens."""
    prompt = engine.tokenizer.encode_chat(messages)
    a = await answer(engine, prompt, greedy(max_tokens))
    return {
        "tokens": len(a.ids) - 1,  # the first is the prefill's
        "seconds": a.decode_s,
        "ttft": a.ttft,
        "steps": a.usage.spec_steps,
        "accepted": a.usage.accepted_tokens,
        "copied": copied(prompt, a.ids),
        "answer": len(a.ids),
    }


def copied(prompt: list[int], answer: list[int]) -> int:
    """Answer tokens inside a run of COPY_RUN tokens that also occurs in the prompt."""
    runs = {tuple(prompt[i : i + COPY_RUN]) for i in range(len(prompt) - COPY_RUN + 1)}
    covered = [False] * len(answer)
    for i in range(len(answer) - COPY_RUN + 1):
        if tuple(answer[i : i + COPY_RUN]) in runs:
            covered[i : i + COPY_RUN] = [True] * COPY_RUN
    return sum(covered)


def run_tasks(args: argparse.Namespace) -> list[dict[str, Any]]:
    """args.tasks by every method, each in an engine process of its own, taking each task in
    turn; a row per method."""
    methods = ["none"] + [m for m in args.methods if m != "none"]
    kv = KVConfig(num_pages=args.num_pages, prefix_cache=not args.no_prefix_cache)

    def config(method: str) -> EngineConfig:
        spec = SpecConfig(method, num_speculative_tokens=args.k, adaptive_k=not args.fixed_k)
        return EngineConfig(args.model, spec, kv, max_running=1, weights=args.weights)

    cells = {m: EngineProcess(config(m)) for m in methods}
    keys = ("tokens", "seconds", "ttft", "steps", "accepted", "copied", "answer")
    totals = {m: dict.fromkeys(keys, 0.0) for m in methods}
    try:
        for cell in cells.values():  # warm-up: the cost model's first estimates
            cell.run(edit, user(edit_prompts()[0]), 32)
        for _ in range(args.rounds):
            for messages in args.tasks:  # task by task, each method in turn
                for method, cell in cells.items():
                    for key, value in cell.run(edit, messages, args.max_tokens).items():
                        totals[method][key] += value
    finally:
        for cell in cells.values():
            cell.close()
    rows = []
    base = totals["none"]["tokens"] / totals["none"]["seconds"]
    for method, t in totals.items():
        speed, steps = t["tokens"] / t["seconds"], t["steps"]
        row = {
            "method": method,
            "tok_s": round(speed, 2),
            "vs_none": round(speed / base, 3),
            "tokens_per_spec_step": round(1 + t["accepted"] / steps, 2) if steps else None,
            "copied_share": round(t["copied"] / t["answer"], 3),
            "ttft_mean_s": round(t["ttft"] / (len(args.tasks) * args.rounds), 3),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


async def chat_turns(args: argparse.Namespace) -> list[list[dict[str, str]]]:
    """The chats' turns, each its whole history, answered by plain decoding (greedy), so that
    every drafter serves the same requests."""
    plain = SpecConfig("none")
    engine = AsyncEngine(EngineConfig(args.model, plain, KVConfig(num_pages=args.num_pages)))
    await engine.start()
    turns = []
    try:
        asked = iter(questions())
        for opening in chat_openings(args.chats):
            messages = user(opening)
            for _ in range(args.turns):
                turns.append(list(messages))
                prompt = engine.tokenizer.encode_chat(messages)
                text = (await answer(engine, prompt, greedy(args.max_tokens))).text
                messages += [{"role": "assistant", "content": text}, *user(next(asked))]
    finally:
        await engine.stop()
    return turns


async def run_llama(args: argparse.Namespace) -> list[dict[str, Any]]:
    """The same tasks through llama-server (the same GGUF; the same prompt ids, from our
    tokenizer's chat template; greedy, eos honoured, its prompt cache on), one server per
    --spec-type, the edits' first task as a warm-up (as ours); its own timings give decode
    tokens/s and the time to first token (its prompt's processing)."""
    import tempfile

    import aiohttp

    from bench.peer import llama_spec_flags
    from bench.served import serving
    from engine.builder import model_path
    from models.tokenizer import Tokenizer

    gguf = model_path(args.model)
    tokenizer = Tokenizer(gguf)
    prompt_ids = [tokenizer.encode_chat(messages) for messages in args.tasks]
    warm_up = tokenizer.encode_chat(user(edit_prompts()[0]))
    log = Path(tempfile.mkdtemp()) / "llama-server.log"
    rows = []
    for spec in ("none", "ngram-simple", "ngram-mod"):
        command = [str(args.llama_server), "-m", str(gguf), "-t", "2", "-tb", "2", "-np", "1",
                   "-c", "8192", "--host", "127.0.0.1", "--no-webui",
                   *llama_spec_flags(spec, args.k)]  # fmt: skip
        keys = ("tokens", "seconds", "ttft", "drafted", "accepted", "copied", "answer")
        totals = dict.fromkeys(keys, 0.0)
        async with serving(command, log, 120) as (url, _), aiohttp.ClientSession() as session:
            tasks = [warm_up] + prompt_ids * args.rounds
            for i, ids in enumerate(tasks):
                body = {"prompt": ids, "n_predict": args.max_tokens, "temperature": 0,
                        "cache_prompt": True, "return_tokens": True}  # fmt: skip
                async with session.post(url + "/completion", json=body) as response:
                    reply = await response.json()
                if i == 0:  # the warm-up
                    continue
                t = reply["timings"]
                totals["tokens"] += t["predicted_n"]
                totals["seconds"] += t["predicted_ms"] / 1e3
                totals["ttft"] += t["prompt_ms"] / 1e3
                totals["drafted"] += t.get("draft_n", 0)
                totals["accepted"] += t.get("draft_n_accepted", 0)
                totals["copied"] += copied(ids, reply["tokens"])
                totals["answer"] += len(reply["tokens"])
        drafted = totals["drafted"]
        row = {
            "llama.cpp": spec,
            "tok_s": round(totals["tokens"] / totals["seconds"], 2),
            "acceptance": round(totals["accepted"] / drafted, 3) if drafted else None,
            "copied_share": round(totals["copied"] / totals["answer"], 3),
            "ttft_mean_s": round(totals["ttft"] / (len(tasks) - 1), 3),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
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
    parser.add_argument("--workload", choices=("chats", "turns", "edits", "echo"), default="chats")
    parser.add_argument("--model", default="smollm2", help="smollm2, a path, or demo")
    parser.add_argument("--methods", nargs="+", default=["none", "ngram", "suffix"])
    parser.add_argument("--rounds", type=int, default=1, help="edits: passes over the tasks")
    parser.add_argument("--k", type=int, default=4, help="edits: the most draft tokens a step")
    parser.add_argument("--chats", type=int, default=3)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=None, help="chats 64, edits 768")
    parser.add_argument("--num-pages", type=int, default=512, help="KV pages of each engine")
    parser.add_argument("--no-prefix-cache", action="store_true", help="turns, edits, echo")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    parser.add_argument("--llama-server", type=Path, help="turns, edits, echo: llama.cpp's")
    parser.add_argument(
        "--weights", choices=WEIGHTS, default="auto", help="our weights (server.py --weights)"
    )
    parser.add_argument("--fixed-k", action="store_true", help="turns, edits, echo: no cost model")
    args = parser.parse_args(argv)
    if args.workload in ("turns", "edits", "echo"):
        if args.workload == "turns":
            args.max_tokens = args.max_tokens or 64
            args.tasks = asyncio.run(chat_turns(args))
        else:
            args.max_tokens = args.max_tokens or 768
            prompts = edit_prompts() if args.workload == "edits" else echo_prompts()
            args.tasks = [user(p) for p in prompts]
        rows = asyncio.run(run_llama(args)) if args.llama_server else run_tasks(args)
    else:
        args.max_tokens = args.max_tokens or 64
        rows = asyncio.run(run(args))
        print(summary(rows))
    if args.out:
        write_json(args.out, rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
