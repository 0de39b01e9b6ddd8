"""Helpers for tests that run the engine on tiny checkpoints."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from core.params import SamplingParams
from core.request import Delta, Request
from core.step import Sequence
from engine.builder import DEMO_DIR
from engine.config import DebugConfig, EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from kv.table import PageTable
from models.tokenizer import Tokenizer


def make_config(
    target,
    method="none",
    draft=None,
    k=3,
    pages=256,
    page_size=4,
    spec_kw=None,
    kv_dtype="auto",
    **kw,
):
    """An EngineConfig for tests; spec_kw: more SpecConfig fields. The draft length is fixed
    unless spec_kw asks for the cost model: with drafters as poor as random heads, the cost
    model would soon stop drafting, and the tests would stop testing speculation."""
    draft = str(draft) if draft else None
    fields = {"adaptive_k": False} | (spec_kw or {})
    spec = SpecConfig(method=method, draft=draft, num_speculative_tokens=k, **fields)
    kv = KVConfig(page_size=page_size, num_pages=pages, dtype=kv_dtype)
    debug = {name: kw.pop(name) for name in ("pipelined", "device_delay", "fault") if name in kw}
    return EngineConfig(str(target), spec, kv, DebugConfig(**debug), **kw)


@contextlib.asynccontextmanager
async def running(config: EngineConfig) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(config)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


@contextlib.asynccontextmanager
async def running_parallel(config: EngineConfig) -> AsyncIterator[tuple[AsyncEngine, Any]]:
    """The engine as server.py runs it with --tensor-parallel-size: this process the leader
    rank, the others worker processes (engine.parallel.Workers, yielded beside the engine);
    the process group is left again afterwards."""
    import torch

    from engine.worker import leave, start_leader

    threads = torch.get_num_threads()
    engine, workers = start_leader(config)
    try:
        await engine.start()
        try:
            yield engine, workers
        finally:
            if engine.failure is None:
                await engine.stop()
    finally:
        leave(workers)
        torch.set_num_threads(threads)


def sequence(
    row: int, prompt_len: int, pages: list[int], max_tokens: int = 16, page_size: int = 4, **params
):
    """A decoding Sequence of a prompt of `prompt_len` tokens over the given pages."""
    request = Request(
        f"r{row}",
        list(range(10, 10 + prompt_len)),
        SamplingParams(**{"max_tokens": max_tokens, "temperature": 0} | params),
        0,
        0.0,
    )
    seq = Sequence(request, PageTable(page_size, pages), row)
    seq.prefill_ids = list(request.prompt_ids)
    seq.num_tokens = prompt_len
    return seq


def ragged_prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1, vocab) for _ in range(rng.randint(1, 40))] for _ in range(n)]


def token_ids(deltas: list[Delta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def staggered(engine: AsyncEngine, prompts, params: SamplingParams, seed: int = 0):
    """Submit each prompt after a small random delay; all outputs, in prompt order."""
    rng = random.Random(seed)

    async def one(prompt):
        await asyncio.sleep(rng.random() * 0.05)
        return token_ids(await engine.generate(prompt, params))

    return await asyncio.gather(*(one(p) for p in prompts))


HELDOUT = Path(__file__).resolve().parent.parent / "train" / "heldout_prompts.json"


def heldout(n: int) -> list[list[int]]:
    """The first n held-out chat prompts, as the demo tokenizer's ids."""
    tokenizer = Tokenizer(DEMO_DIR / "target")
    texts = [p["text"] for p in json.loads(HELDOUT.read_text())[:n]]
    return [tokenizer.encode(t) for t in texts]


# Drafters of a tiny target, for tests across dtypes and devices. name: (method, the
# drafter's key in write_drafters' dict, k, more SpecConfig fields)
DRAFTERS = {
    "draft": ("draft", "target", 3, {}),  # the target drafting for itself: drafts accepted
    "ngram": ("ngram", None, 3, {}),
    "eagle": ("eagle", "eagle", 3, {}),
    "eagle-tree": ("eagle", "eagle", 3, {"tree": "dynamic"}),
    "mtp-k": ("mtp", "mtp", 3, {}),
    "mtp-1": ("mtp", "mtp", 1, {}),
    "suffix": ("suffix", None, 3, {}),
    "hybrid": ("hybrid", "eagle", 3, {"hybrid_min_score": 0.5}),
}
# a logit gap float32 may lose in the dtype's rounding through a tiny model's two layers (and
# in float32 on another device, its kernels' order of summation)
ROUNDING = {"float32": 1e-3, "bfloat16": 0.25, "float16": 0.03}


def write_drafters(target: Path, root: Path) -> dict[str, Path]:
    """Random EAGLE and MTP heads of the target's shapes, saved under root."""
    from models.eagle import save_eagle_head
    from models.loader import load_model
    from models.mtp import save_mtp_head
    from tests.tiny import random_eagle_head, random_mtp_head

    model = load_model(target)
    save_eagle_head(random_eagle_head(model, norms=True), root / "eagle")
    save_mtp_head(random_mtp_head(model, seed=7), root / "mtp")
    return {"target": target, "eagle": root / "eagle", "mtp": root / "mtp"}


def assert_departs_only_at_near_ties(
    exact: list[list[Delta]], theirs: list[list[int]], gap: float, what: str = ""
) -> None:
    """Each output equals the reference's (`exact`, generated with logprobs=2) up to a first
    departure, where the reference's top two logits were within `gap`."""
    for deltas, out in zip(exact, theirs, strict=True):
        ours = token_ids(deltas)
        assert len(out) == len(ours), what
        first = next((i for i, (x, y) in enumerate(zip(ours, out, strict=True)) if x != y), None)
        if first is not None:
            top = [lp for d in deltas for lp in d.logprobs][first].top
            assert top[0][1] - top[1][1] < gap, (what, first, top)


def wait_healthy(port: int, seconds: float) -> None:
    """Until the server on `port` answers /health."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        time.sleep(0.2)
    raise AssertionError(f"no healthy server on port {port} within {seconds:g} s")
