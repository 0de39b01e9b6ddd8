"""Self-distillation data for a chat target's heads: `python -m train.chat_data`.

    python -m train.chat_data generate --run-dir RUN     # the target answers the prompts
    python -m train.chat_data tokens --run-dir RUN       # -> RUN/train_tokens.npy, heldout

`generate` sends every training prompt (train/chat_prompts.json), as a one-turn chat, to the
target through our engine in large batches, once greedily and once per sampling temperature,
and appends each conversation (the prompt's and the answer's token ids) to
RUN/conversations.jsonl as it finishes: an interrupted run resumes where it stopped. `tokens`
concatenates them into the token streams `train.heads precompute` reads, the conversations of
the last `--heldout-prompts` prompts held out, then appends text files present on the machine
(train/corpus_files.txt, tokenised by the target's tokenizer) to the training stream. The chat
prompts of the benchmarks (train/chat_heldout_prompts.json) are never trained on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from pathlib import Path

import numpy as np

from engine.config import EngineConfig, SpecConfig
from engine.engine import AsyncEngine
from engine.request import SamplingParams
from models.tokenizer import Tokenizer
from train.corpus import load_corpus
from train.lm import HELDOUT_TOKENS, TRAIN_TOKENS

log = logging.getLogger("train")

PROMPTS = Path(__file__).parent / "chat_prompts.json"
HELDOUT_PROMPTS = Path(__file__).parent / "chat_heldout_prompts.json"
CONVERSATIONS = "conversations.jsonl"
GREEDY = 0.0


def load_prompts(path: Path = PROMPTS) -> list[str]:
    return json.loads(path.read_text())


def chat_ids(tokenizer: Tokenizer, prompt: str) -> list[int]:
    """The token ids of a one-turn chat ready for the assistant's answer."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    return tokenizer.encode(text, add_special_tokens=False)


def read_conversations(run_dir: Path) -> list[dict]:
    path = run_dir / CONVERSATIONS
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def generate(args: argparse.Namespace) -> None:
    prompts = load_prompts()
    temperatures = [GREEDY, *args.temperatures]
    done = {(c["prompt"], c["temperature"]) for c in read_conversations(args.run_dir)}
    jobs = [(i, t) for t in temperatures for i in range(len(prompts)) if (i, t) not in done]
    log.info("%d conversations to generate, %d already there", len(jobs), len(done))
    if not jobs:
        return
    config = EngineConfig(model=args.model, spec=SpecConfig(method="none"), max_running=args.batch)
    engine = AsyncEngine(config)
    await engine.start()
    args.run_dir.mkdir(parents=True, exist_ok=True)
    start, tokens = time.monotonic(), 0
    try:
        with open(args.run_dir / CONVERSATIONS, "a") as out:

            async def one(index: int, temperature: float) -> None:
                nonlocal tokens
                ids = chat_ids(engine.tokenizer, prompts[index])
                params = SamplingParams(
                    max_tokens=args.max_tokens, temperature=temperature, seed=index
                )
                deltas = await engine.generate(ids, params)
                answer = [t for d in deltas for t in d.token_ids]
                record = {"prompt": index, "temperature": temperature, "ids": ids + answer}
                out.write(json.dumps(record) + "\n")
                out.flush()
                tokens += len(answer)

            for first in range(0, len(jobs), args.batch):
                await asyncio.gather(*(one(i, t) for i, t in jobs[first : first + args.batch]))
                elapsed = time.monotonic() - start
                log.info(
                    "%d/%d conversations, %d answer tokens, %.0f tok/s",
                    *(min(first + args.batch, len(jobs)), len(jobs), tokens, tokens / elapsed),
                )
    finally:
        await engine.stop()


def cmd_tokens(args: argparse.Namespace) -> None:
    conversations = read_conversations(args.run_dir)
    if not conversations:
        raise SystemExit(f"no conversations in {args.run_dir}: run `generate` first")
    heldout_from = len(load_prompts()) - args.heldout_prompts
    streams: dict[str, list[int]] = {"train": [], "heldout": []}
    for c in sorted(conversations, key=lambda c: (c["prompt"], c["temperature"])):
        streams["heldout" if c["prompt"] >= heldout_from else "train"].extend(c["ids"])
    chat_tokens = len(streams["train"])
    if args.text_tokens:
        tokenizer = Tokenizer(args.tokenizer_model)
        text, ids = load_corpus().texts("train"), []
        for chunk in text:
            ids.extend(tokenizer.encode(chunk, add_special_tokens=False))
            if len(ids) >= args.text_tokens:
                break
        streams["train"].extend(ids[: args.text_tokens])
    for split, name in (("train", TRAIN_TOKENS), ("heldout", HELDOUT_TOKENS)):
        np.save(args.run_dir / name, np.asarray(streams[split], dtype=np.int32))
    log.info(
        "train: %d tokens (%d of chat, %d of text); heldout: %d tokens of chat",
        *(len(streams["train"]), chat_tokens, len(streams["train"]) - chat_tokens),
        len(streams["heldout"]),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m train.chat_data", description=__doc__.split("\n")[0]
    )
    p.add_argument("--run-dir", type=Path, required=True)
    p.add_argument("--model", default="smollm2", help="the target (as server.py's --model)")
    sub = p.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="the target's answers to the training prompts")
    gen.add_argument("--temperatures", type=float, nargs="*", default=[0.7, 1.0],
                     help="sampled answers besides the greedy one")  # fmt: skip
    gen.add_argument("--max-tokens", type=int, default=320)
    gen.add_argument("--batch", type=int, default=48, help="requests in flight")
    tok = sub.add_parser("tokens", help="the token streams for train.heads precompute")
    held = "the last N training prompts' answers form the held-out split"
    tok.add_argument("--heldout-prompts", type=int, default=12, help=held)
    text = "tokens of text from the machine appended to the training split"
    tok.add_argument("--text-tokens", type=int, default=60_000, help=text)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    if args.command == "generate":
        asyncio.run(generate(args))
    else:
        from engine.builder import model_path

        args.tokenizer_model = model_path(args.model)
        cmd_tokens(args)


if __name__ == "__main__":
    main()
