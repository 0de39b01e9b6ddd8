"""What `--quantization int8` costs in accuracy.

    python -m bench.quantization [--model DIR] [--prompts 8] [--max-tokens 64] [--windows 64]

Two measures, float32 against weight-only int8 (models/linear.py: FusedLinear's int8):
- the demo target's mean next-token loss over held-out windows of the demo corpus (files the
  target never trained on), and its delta;
- greedy agreement on a real model (`--model`, a Hugging Face directory): the engine without
  speculation continues the held-out chat prompts greedily in both modes, and the report gives
  the share of tokens equal at the same position and how many tokens each request keeps
  before its first difference.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
from pathlib import Path

import torch

from bench.common import heldout_prompts
from engine.builder import DEMO_DIR
from engine.config import EngineConfig
from engine.engine import AsyncEngine
from engine.request import SamplingParams
from models.llama import prepare_for_inference
from models.loader import load_model
from models.tokenizer import Tokenizer
from train import corpus, data
from train.objectives import heldout_loss

WINDOW = 256  # tokens a held-out window scores


def demo_loss_delta(windows: int) -> dict:
    tokenizer = Tokenizer(DEMO_DIR / "target")
    ids = [t for text in corpus.load_corpus().texts("heldout") for t in tokenizer.encode(text)]
    rows = data.fixed_windows(torch.tensor(ids).numpy(), windows, WINDOW)
    losses = {}
    for int8 in (False, True):
        model = load_model(DEMO_DIR / "target")
        with torch.inference_mode():
            prepare_for_inference(model, int8=int8)
            losses["int8" if int8 else "float32"] = heldout_loss(model, rows)
    return {
        "windows": len(rows),
        "window_tokens": WINDOW,
        **losses,
        "delta": losses["int8"] - losses["float32"],
    }


async def greedy_tokens(config: EngineConfig, prompts: list[str], max_tokens: int) -> list:
    engine = AsyncEngine(config)
    await engine.start()
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outs = [await engine.generate(p, params) for p in prompts]
        return [[t for d in deltas for t in d.token_ids] for deltas in outs]
    finally:
        await engine.stop()


def greedy_agreement(model: Path, prompts: int, max_tokens: int) -> dict:
    texts = heldout_prompts(prompts)
    runs = {}
    for quantization in (None, "int8"):
        config = EngineConfig(model=str(model), quantization=quantization)
        runs[quantization or "float32"] = asyncio.run(greedy_tokens(config, texts, max_tokens))
    same, prefixes = 0, []
    for a, b in zip(runs["float32"], runs["int8"], strict=True):
        same += sum(x == y for x, y in zip(a, b, strict=True))
        prefixes.append(
            next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))
        )
    total = sum(len(a) for a in runs["float32"])
    return {
        "model": str(model),
        "prompts": len(texts),
        "max_tokens": max_tokens,
        "same_position_share": same / total,
        "tokens_before_first_difference": prefixes,
        "median_tokens_before_first_difference": statistics.median(prefixes),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="a Hugging Face directory (greedy agreement)")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--windows", type=int, default=64)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    report = {"demo": demo_loss_delta(args.windows)}
    if args.model:
        report["greedy"] = greedy_agreement(args.model, args.prompts, args.max_tokens)
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
