"""Self-distillation data for a chat target's heads: `python -m train.chat_data`.

    python -m train.chat_data generate --data DIR      # the target answers the pool's prompts
    python -m train.chat_data tokens --data DIR --run-dir RUN   # -> RUN/train_tokens.npy, ...

`generate` sends every prompt of DIR's pool (train.prompts), as a one-turn chat, to the target
through our engine, once greedily and once per sampling temperature, keeping `--batch` requests
in flight (a finished one is replaced at once, so the batch stays full), and appends the
conversations (prompt and answer token ids) to DIR in compressed shards of uint16 ids as they
finish: an interrupted run resumes where it stopped, and shards are never rewritten. `tokens`
concatenates them into the token streams `train.heads precompute` reads: the conversations of
one prompt in VALIDATION_EVERY form the validation split (checkpoints are chosen on it); then
text files present on the machine (train/corpus_files.txt, tokenised by the target's
tokenizer) are appended to the training stream. The chat prompts of the benchmarks
(train/chat_heldout_prompts.json) are never trained on, nor anything near them (train.prompts).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from core.params import SamplingParams
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from models.tokenizer import Tokenizer
from train.corpus import load_corpus
from train.lm import HELDOUT_TOKENS, TRAIN_TOKENS
from train.prompts import OFFLINE_WATCHDOG_S, POOL, read_pool

log = logging.getLogger("train")

PROMPTS = Path(__file__).parent / "chat_prompts.json"
HELDOUT_PROMPTS = Path(__file__).parent / "chat_heldout_prompts.json"
GREEDY = 0.0
VALIDATION_EVERY = 50  # prompt ids divisible by this form the validation split
MIN_ANSWER_ROOM = 16  # tokens of context an answer needs, else the prompt is skipped


def load_prompts(path: Path = PROMPTS) -> list[str]:
    return json.loads(path.read_text())


def chat_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The token ids of a one-turn chat ready for the assistant's answer."""
    return tokenizer.encode_chat([{"role": "user", "content": prompt}])


@dataclass
class Shard:
    """Conversations as one compressed file: their ids joined (uint16), with offsets."""

    prompt: list[int] = field(default_factory=list)  # [n] the pool's prompt id
    temperature: list[float] = field(default_factory=list)  # [n]
    answer_start: list[int] = field(default_factory=list)  # [n] where the answer begins
    ids: list[list[int]] = field(default_factory=list)  # [n] prompt + answer

    def add(self, prompt: int, temperature: float, ids: list[int], answer_start: int) -> None:
        self.prompt.append(prompt)
        self.temperature.append(temperature)
        self.answer_start.append(answer_start)
        self.ids.append(ids)

    def save(self, path: Path) -> None:
        lengths = [len(i) for i in self.ids]
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez_compressed(
            tmp,
            tokens=np.asarray([t for i in self.ids for t in i], dtype=np.uint16),
            offsets=np.cumsum([0, *lengths]).astype(np.int64),
            prompt=np.asarray(self.prompt, dtype=np.int32),
            temperature=np.asarray(self.temperature, dtype=np.float32),
            answer_start=np.asarray(self.answer_start, dtype=np.int32),
        )
        tmp.replace(path)


def read_shards(data: Path) -> list[dict]:
    """Every conversation of DIR's shards: {"prompt", "temperature", "ids", "answer_start"}."""
    conversations = []
    for path in sorted(data.glob("answers-*.npz")):
        with np.load(path) as shard:  # each access decompresses: read every array once
            fields = {name: shard[name] for name in shard.files}
        tokens, offsets = fields["tokens"].astype(np.int64), fields["offsets"]
        for j, prompt in enumerate(fields["prompt"].tolist()):
            conversations.append(
                {
                    "prompt": prompt,
                    "temperature": round(float(fields["temperature"][j]), 3),
                    "ids": tokens[offsets[j] : offsets[j + 1]].tolist(),
                    "answer_start": int(fields["answer_start"][j]),
                }
            )
    return conversations


async def generate(args: argparse.Namespace) -> None:
    pool = read_pool(args.data / POOL)
    if not pool:
        raise SystemExit(f"no prompts in {args.data / POOL}: run `python -m train.prompts`")
    temperatures = [GREEDY, *args.temperatures]
    done = {(c["prompt"], c["temperature"]) for c in read_shards(args.data)}
    jobs = [(p["id"], t) for p in pool for t in temperatures if (p["id"], round(t, 3)) not in done]
    random.Random(0).shuffle(jobs)  # so that what a stopped run leaves mixes every source
    log.info("%d conversations to generate, %d already there", len(jobs), len(done))
    if not jobs:
        return
    config = EngineConfig(
        model=args.model,
        spec=SpecConfig(method="none"),
        max_running=args.batch,
        kv=KVConfig(memory_bytes=int(args.kv_gib * (1 << 30))),  # a full batch, no preemption
        watchdog_s=OFFLINE_WATCHDOG_S,
    )
    engine = AsyncEngine(config)
    await engine.start()
    texts = {p["id"]: p["text"] for p in pool}
    queue: asyncio.Queue[tuple[int, float]] = asyncio.Queue()
    for job in jobs:
        queue.put_nowait(job)
    shard, number = Shard(), len(list(args.data.glob("answers-*.npz")))
    start, answered, finished = time.monotonic(), 0, 0

    def flush() -> None:
        nonlocal shard, number
        if shard.ids:
            shard.save(args.data / f"answers-{number:05d}.npz")
            shard, number = Shard(), number + 1

    deadline = start + args.minutes * 60 if args.minutes else float("inf")

    async def worker() -> None:
        nonlocal answered, finished
        while not queue.empty() and time.monotonic() < deadline:
            prompt, temperature = queue.get_nowait()
            ids = chat_ids(engine.tokenizer, texts[prompt])
            room = min(args.max_tokens, engine.max_model_len - len(ids))
            if room < min(MIN_ANSWER_ROOM, args.max_tokens):  # a prompt too long for the context
                continue
            # unseeded: the engine derives a seed from the request, and samples by the
            # rejection rule, cheaper than the seeded coupling over a large vocabulary
            params = SamplingParams(max_tokens=room, temperature=temperature)
            answer = [t for d in await engine.generate(ids, params) for t in d.token_ids]
            shard.add(prompt, temperature, ids + answer, len(ids))
            answered, finished = answered + len(answer), finished + 1
            if len(shard.ids) >= args.shard_size:
                flush()
            if finished % 100 == 0:
                rate = answered / (time.monotonic() - start)
                eta = (len(jobs) - finished) * (answered / finished) / rate
                log.info(
                    "%d/%d conversations, %d answer tokens, %.0f tok/s, %.1f h left",
                    finished,
                    len(jobs),
                    answered,
                    rate,
                    eta / 3600,
                )

    try:
        await asyncio.gather(*(worker() for _ in range(args.batch)))
    finally:
        flush()
        await engine.stop()


def cmd_tokens(args: argparse.Namespace) -> None:
    conversations = read_shards(args.data)
    if not conversations:
        raise SystemExit(f"no conversations in {args.data}: run `generate` first")
    streams: dict[str, list[int]] = {"train": [], "heldout": []}
    for c in sorted(conversations, key=lambda c: (c["prompt"], c["temperature"])):
        streams["heldout" if c["prompt"] % VALIDATION_EVERY == 0 else "train"].extend(c["ids"])
    chat_tokens = len(streams["train"])
    if args.text_tokens:
        tokenizer = Tokenizer(args.tokenizer_model)
        text, ids = load_corpus().texts("train"), []
        for chunk in text:
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False))
            if len(ids) >= args.text_tokens:
                break
        streams["train"].extend(ids[: args.text_tokens])
    args.run_dir.mkdir(parents=True, exist_ok=True)
    for split, name in (("train", TRAIN_TOKENS), ("heldout", HELDOUT_TOKENS)):
        np.save(args.run_dir / name, np.asarray(streams[split], dtype=np.int32))
    log.info(
        "train: %d tokens (%d of chat, %d of text); validation: %d tokens of chat",
        *(len(streams["train"]), chat_tokens, len(streams["train"]) - chat_tokens),
        len(streams["heldout"]),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.chat_data", description=__doc__.split("\n")[0]
    )
    p.add_argument("--data", type=Path, required=True, help="the pool's and the shards' folder")
    p.add_argument("--model", default="smollm2", help="the target (as server.py's --model)")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="the target's answers to the pool's prompts")
    gen.add_argument(
        "--temperatures",
        type=float,
        nargs="*",
        default=[0.7, 1.0],
        help="sampled answers besides the greedy one",
    )
    gen.add_argument("--max-tokens", type=int, default=320)
    gen.add_argument("--batch", type=int, default=64, help="requests in flight")
    gen.add_argument("--shard-size", type=int, default=256, help="conversations a shard")
    gen.add_argument("--kv-gib", type=float, default=2.0, help="KV cache memory (GiB)")
    gen.add_argument("--minutes", type=float, default=0, help="start no answer after this")
    tok = sub.add_parser("tokens", help="the token streams for train.heads precompute")
    tok.add_argument("--run-dir", type=Path, required=True)
    text = "tokens of text from the machine appended to the training split"
    tok.add_argument("--text-tokens", type=int, default=60_000, help=text)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.command == "generate":
        args.data.mkdir(parents=True, exist_ok=True)
        asyncio.run(generate(args))
    else:
        from engine.builder import model_path

        args.tokenizer_model = model_path(args.model)
        cmd_tokens(args)


if __name__ == "__main__":
    main()
