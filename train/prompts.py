"""The prompt pool of a chat target's self-distillation data: `python -m train.prompts`.

Three sources, no hub:
- `self`: the model writes user turns itself (Magpie): the chat template up to the opening of a
  user turn, sampled at temperature 1 until the turn ends; a turn cut by the length limit, too
  short, with few letters or repeating itself is dropped.
- `given`: the hand-written training prompts (train/chat_prompts.json).
- `text`: snippets of the machine's own text (the standard library's code and docstrings of
  train/corpus_files.txt, the demo corpus's training split) turned into tasks: explain,
  summarise, continue, rewrite, document, find the bug.

Every prompt is kept once (by its normalised words), and none is near a held-out benchmark
prompt (train/chat_heldout_prompts.json): a prompt sharing half of its word trigrams with one,
or equal to one once normalised, is dropped (`near_heldout`). The pool is append-only JSON
lines, {"id", "source", "text"}; an interrupted run adds to what is there.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gzip
import json
import logging
import random
import re
import time
from collections.abc import Iterator
from pathlib import Path

from core.params import SamplingParams
from engine.config import EngineConfig, SpecConfig
from engine.engine import AsyncEngine
from models.tokenizer import Tokenizer
from train.corpus import load_corpus

log = logging.getLogger("train")

HERE = Path(__file__).parent
GIVEN = HERE / "chat_prompts.json"
HELDOUT = HERE / "chat_heldout_prompts.json"
POOL = "prompts.jsonl.gz"
# an offline job has no supervisor to restart it, and may be paused (SIGSTOP) for as long as
# a benchmark beside it runs: its engine's watchdog waits a day, not a minute
OFFLINE_WATCHDOG_S = 24 * 3600.0
NEAR = 0.5  # share of a prompt's word trigrams found in a held-out prompt that drops it
TASKS = [  # (what to ask, the snippet's fence): a snippet of code or text follows each
    ("Explain what this Python code does:", "python"),
    ("Summarise what this code is for in a few sentences:", "python"),
    ("Rewrite this code to be easier to read, and explain the changes:", "python"),
    ("Write a docstring for this code:", "python"),
    ("Is there a bug in this code? Explain.", "python"),
    ("Continue this code:", "python"),
    ("Explain this documentation in simple words:", ""),
    ("Summarise this text:", ""),
    ("Write three questions a student could ask about this text, and answer them:", ""),
]


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def trigrams(text: str) -> set[tuple[str, ...]]:
    w = words(text)
    return {tuple(w[i : i + 3]) for i in range(len(w) - 2)} or {tuple(w)}


def near_heldout(text: str, heldout: list[set[tuple[str, ...]]]) -> bool:
    mine = trigrams(text)
    return any(len(mine & theirs) >= NEAR * min(len(mine), len(theirs)) for theirs in heldout)


def degenerate(text: str) -> bool:
    """Too short, mostly not letters, or repeating itself (a word trigram seen 3 times)."""
    w = words(text)
    letters = sum(c.isalpha() for c in text)
    if len(w) < 4 or letters < 0.5 * len(text.strip()):
        return True
    counts: dict[tuple[str, ...], int] = {}
    for i in range(len(w) - 2):
        gram = tuple(w[i : i + 3])
        counts[gram] = counts.get(gram, 0) + 1
    return max(counts.values(), default=0) >= 3


class Pool:
    """The append-only prompt pool: distinct prompts, none near a held-out one."""

    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.prompts = read_pool(path)
        self.seen = {" ".join(words(p["text"])) for p in self.prompts}
        self.heldout = [trigrams(t) for t in json.loads(HELDOUT.read_text())]
        self.dropped = {"duplicate": 0, "near held-out": 0, "degenerate": 0}

    def count(self, source: str) -> int:
        return sum(p["source"] == source for p in self.prompts)

    def add(self, source: str, text: str, check_degenerate: bool = False) -> bool:
        key = " ".join(words(text))
        reason = None
        if check_degenerate and degenerate(text):
            reason = "degenerate"
        elif key in self.seen:
            reason = "duplicate"
        elif near_heldout(text, self.heldout):
            reason = "near held-out"
        if reason is not None:
            self.dropped[reason] += 1
            return False
        self.seen.add(key)
        record = {"id": len(self.prompts), "source": source, "text": text}
        self.prompts.append(record)
        with gzip.open(self.path, "at") as out:  # each record its own gzip member: appendable
            out.write(json.dumps(record) + "\n")
        return True


def read_pool(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def text_tasks(seed: int) -> Iterator[str]:
    """Tasks over snippets of the corpus's training files, in a seeded order."""
    corpus = load_corpus()
    rng = random.Random(seed)
    files = list(corpus.train)
    while True:
        text = corpus.read(rng.choice(files))
        ask, fence = rng.choice(TASKS)
        snippet = docstring(text, rng) if not fence else code_lines(text, rng)
        if snippet:
            body = f"```{fence}\n{snippet}\n```" if fence else snippet
            yield f"{ask}\n\n{body}"


def code_lines(text: str, rng: random.Random) -> str | None:
    lines = text.splitlines()
    if len(lines) < 8:
        return None
    n = rng.randint(5, 25)
    start = rng.randrange(max(len(lines) - n, 1))
    snippet = "\n".join(lines[start : start + n]).strip("\n")
    return snippet if len(snippet.strip()) > 40 else None


def docstring(text: str, rng: random.Random) -> str | None:
    found = [d.strip() for d in re.findall(r'"""(.*?)"""', text, re.S) if len(d.split()) >= 25]
    if not found:
        return None
    chosen = rng.choice(found)
    return " ".join(chosen.split()[:200])


async def self_written(engine: AsyncEngine, count: int) -> list[str]:
    """`count` user turns the model writes (Magpie). The requests bring no seed: the engine
    derives one from its own seed and the request (so that a run can be repeated), and they
    sample by the plain rule, cheaper than the seeded coupling over a large vocabulary."""
    opening, end = user_turn(engine.tokenizer)
    params = dataclasses.replace(end, max_tokens=96, temperature=1.0, top_p=0.98)

    async def one() -> str | None:
        deltas = await engine.generate(opening, params)
        if deltas[-1].finish_reason != "stop":  # cut by the length limit
            return None
        return "".join(d.text for d in deltas).strip()

    texts = await asyncio.gather(*(one() for _ in range(count)))
    return [t for t in texts if t]


def user_turn(tokenizer: Tokenizer) -> tuple[list[int], SamplingParams]:
    """The template's ids up to where a user's words begin (after its default system turn),
    and what ends the turn: the template's special token there (ChatML's <|im_end|>), else
    the text it writes after the words."""
    marker = "\ue000"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], False)
    before, after = text.split(marker, 1)
    opening = tokenizer.encode(before, add_special_tokens=False)
    special = next((s for s in tokenizer.specials if after.startswith(s)), None)
    if special is not None:
        return opening, SamplingParams(stop_token_ids=(tokenizer.specials[special],))
    return opening, SamplingParams(stop=(after.strip() or after,))


async def build(args: argparse.Namespace) -> None:
    pool = Pool(args.out)
    for text in json.loads(GIVEN.read_text()):
        pool.add("given", text)
    tasks = text_tasks(args.seed + pool.count("text"))
    while pool.count("text") < args.text:
        pool.add("text", next(tasks))
    if pool.count("self") < args.self_written:
        config = EngineConfig(
            model=args.model,
            spec=SpecConfig("none"),
            max_running=args.batch,
            watchdog_s=OFFLINE_WATCHDOG_S,
            seed=args.seed * 1_000_003 + pool.count("self"),  # a resumed run draws anew
        )
        engine = AsyncEngine(config)
        await engine.start()
        try:
            deadline = time.monotonic() + args.minutes * 60 if args.minutes else float("inf")
            while (missing := args.self_written - pool.count("self")) > 0:
                if time.monotonic() > deadline:
                    log.info("the time budget is spent: %d self-written", pool.count("self"))
                    break
                for text in await self_written(engine, min(missing, args.batch * 4)):
                    pool.add("self", text, check_degenerate=True)
                log.info(
                    "self-written: %d of %d (dropped %s)",
                    pool.count("self"),
                    args.self_written,
                    pool.dropped,
                )
        finally:
            await engine.stop()
    sources = {s: pool.count(s) for s in ("given", "text", "self")}
    log.info("pool: %s prompts; dropped %s", sources, pool.dropped)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m train.prompts", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help=f"the pool file ({POOL})")
    p.add_argument("--model", default="smollm2", help="the target (as server.py's --model)")
    p.add_argument("--self-written", type=int, default=3000, help="prompts the model writes")
    p.add_argument("--text", type=int, default=2000, help="tasks over the machine's text")
    p.add_argument("--batch", type=int, default=64, help="requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--minutes", type=float, default=0, help="stop writing after this (0: never)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    asyncio.run(build(args))


if __name__ == "__main__":
    main()
