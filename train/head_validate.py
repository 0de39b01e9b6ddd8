"""Validate a trained head through the engine's own inference path.

The head directory is loaded by the engine (`AsyncEngine` with an EAGLE or MTP `SpecConfig`),
which decodes the held-out prompts greedily: the demo's held-out code prompts, or with `--chat`
the held-out chat prompts (train/chat_heldout_prompts.json) as one-turn chats. What it reports
comes from the engine's counters:

- acceptance length: tokens emitted per verify step, (steps + accepted) / steps, from the
  requests' usage (steps that could draft nothing, at a request's last token, count too);
- per draft position i: the share of drafts whose first i+1 tokens were all accepted, and the
  top-1 accuracy at depth i+1 given the earlier ones were right (greedy: a draft token is
  accepted exactly when it is the target's argmax), from the engine's metrics.

Alongside, the head's loss terms on the held-out precomputed data (teacher-forced, depth 1).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import time
from itertools import pairwise
from pathlib import Path

import torch

from core.params import SamplingParams
from core.request import Usage
from engine.builder import model_path
from engine.config import EngineConfig, SpecConfig
from engine.engine import AsyncEngine
from models.eagle import load_eagle_head
from models.loader import load_model
from models.mtp import load_mtp_head
from models.tokenizer import Tokenizer
from train import chat_data, corpus, head_data, head_train

COUNTERS = {
    "drafts": "tandem_spec_decode_num_drafts_total",
    "draft_tokens": "tandem_spec_decode_num_draft_tokens_total",
    "accepted_tokens": "tandem_spec_decode_num_accepted_tokens_total",
}
PER_POSITION = re.compile(
    r'^tandem_spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$', re.M
)


def method_of(kind: str) -> str:
    return "mtp" if kind == "mtp" else "eagle"


def engine_config(target: str, kind: str, head: Path, k: int, max_running: int) -> EngineConfig:
    """A fixed k (no adaptive draft length), so that every draft position is measured."""
    spec = SpecConfig(
        method=method_of(kind), draft=str(head), num_speculative_tokens=k, adaptive_k=False
    )
    return EngineConfig(model=target, spec=spec, max_running=max_running)


def read_counters(text: str) -> dict:
    """The speculation counters of the engine's Prometheus text."""
    values = {}
    for name, metric in COUNTERS.items():
        found = re.search(rf"^{metric} (\S+)$", text, re.M)
        if found is None:
            raise ValueError(f"the engine's metrics lack {metric}")
        values[name] = int(float(found.group(1)))
    positions = sorted((int(p), int(float(v))) for p, v in PER_POSITION.findall(text))
    values["accepted_per_position"] = [v for _, v in positions]
    return values


async def _usage(engine: AsyncEngine, prompt: str | list[int], params: SamplingParams) -> Usage:
    deltas = await engine.generate(prompt, params)
    usage = deltas[-1].usage
    if usage is None:
        raise RuntimeError(f"request ended without usage: {deltas[-1].error}")
    return usage


async def engine_acceptance(
    config: EngineConfig, prompts: list[str] | list[list[int]], new_tokens: int
) -> dict:
    """Greedy decoding of all prompts at once in an engine built from `config`; the requests'
    usage summed, the engine's speculation counters, and what follows from them."""
    engine = AsyncEngine(config)
    await engine.start()
    started = time.perf_counter()
    try:
        params = SamplingParams(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        usages = await asyncio.gather(*(_usage(engine, p, params) for p in prompts))
        seconds = time.perf_counter() - started
        counters = read_counters(engine.metrics.render())
    finally:
        await engine.stop()
    usage = {
        name: sum(getattr(u, name) for u in usages)
        for name in ("completion_tokens", "spec_steps", "draft_tokens", "accepted_tokens")
    }
    return {
        "usage": usage,
        "counters": counters,
        "acceptance_length": (usage["spec_steps"] + usage["accepted_tokens"]) / usage["spec_steps"],
        **per_position(counters),
        "seconds": seconds,
        "tokens_per_s": usage["completion_tokens"] / seconds,
    }


def per_position(counters: dict) -> dict:
    """Share of drafts accepted through position i, and top-1 accuracy at depth i+1 given
    the earlier positions were accepted."""
    reached = [counters["drafts"], *counters["accepted_per_position"]]
    return {
        "accepted_through_position": [n / reached[0] for n in reached[1:]],
        "top1_given_previous": [n / r if r else 0.0 for r, n in pairwise(reached)],
    }


def heldout_loss(target_name: str, kind: str, head_dir: Path, data_dir: Path) -> dict:
    """Loss terms of the exported head (as the engine loads it) on the held-out store."""
    target = load_model(model_path(target_name), dtype=torch.float32, device="cpu")
    loader = load_mtp_head if kind == "mtp" else load_eagle_head
    head = loader(head_dir, target)
    if head_train.head_kind(head) != kind:
        raise ValueError(f"{head_dir} holds a {head_train.head_kind(head)} head, not {kind}")
    data = head_train.HeadData(head_data.load_split(data_dir, "heldout"))
    return head_train.heldout_metrics(head, data, head_train.HeadLoss.default(kind))


def run(args: argparse.Namespace) -> dict:
    prompts: list[str] | list[list[int]] = corpus.load_prompts()
    if args.chat:
        tokenizer = Tokenizer(model_path(args.target))
        chats = chat_data.load_prompts(chat_data.HELDOUT_PROMPTS)
        prompts = [chat_data.chat_ids(tokenizer, p) for p in chats]
    prompts = prompts[: args.prompts] if args.prompts else prompts
    config = engine_config(args.target, args.kind, args.head, args.k, len(prompts))
    result = {
        "kind": args.kind,
        "head": str(args.head),
        "k": args.k,
        "prompts": len(prompts),
        "new_tokens": args.new_tokens,
        "heldout": heldout_loss(args.target, args.kind, args.head, args.run_dir / "heads-data"),
    }
    return result | asyncio.run(engine_acceptance(config, prompts, args.new_tokens))


def table(heads_dir: Path) -> str:
    """A Markdown table of every head with a validate.json under `heads_dir`."""
    rows = [
        "| head | steps | held-out loss | feature | CE | top-1 (held-out) "
        "| top-1 by depth (engine) | acceptance length |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for path in sorted(heads_dir.glob("*/validate.json")):
        v = json.loads(path.read_text())
        trained = path.parent / "train.json"
        steps = json.loads(trained.read_text())["steps"] if trained.exists() else "?"
        h = v["heldout"]
        depth = " / ".join(f"{a:.3f}" for a in v["top1_given_previous"])
        rows.append(
            f"| {v['kind']} | {steps} | {h['loss']:.4f} | {h.get('feature', 0):.4f} "
            f"| {h.get('ce', h.get('ce0', 0)):.4f} "
            f"| {h.get('top1', h.get('top1_0', 0)):.3f} | {depth} "
            f"| {v['acceptance_length']:.3f} (k={v['k']}) |"
        )
    return "\n".join(rows)
