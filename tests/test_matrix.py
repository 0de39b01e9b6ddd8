"""Every combination a user can start: model x dtype x drafter, each feature one at a time.

One engine per (model, dtype, drafter), built by the server's own flags (server.py's
config_from_args) with the cost model choosing k, runs a set of workloads, each walking one
feature: a batch of ragged prompts, a prefix-cache hit, a JSON schema, a seeded sampled
request, a burst that preempts; on the demo pair the cost model's k = 0 steps exercise the
draft model's lazy refill (asserted where it happens). Greedy output equals plain decoding's
at the same dtype but where plain decoding's top two logits are within the dtype's rounding
(ROUNDING), seeded output equals plain's seeded output, and every page is free at the end. A
second engine per row runs the batch with `--cuda-graphs on` (static buffers, eager on the
CPU). Combinations that cannot work are refused at start with a message naming the flags:
REFUSED lists them, and a test holds each refusal.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from core.params import Grammar, SamplingParams
from engine.config import DebugConfig
from engine.engine import AsyncEngine
from server import config_from_args
from tests.engine_util import (
    ROUNDING,
    assert_departs_only_at_near_ties,
    ragged_prompts,
    running,
    token_ids,
)
from tests.fakes import served
from tests.tiny import write_qwen2_pair

DTYPES = ("float32", "bfloat16", "float16")
DEEPSEEK = Path(__file__).resolve().parent.parent / "models" / "demo" / "deepseek"
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=2)
BURST = dataclasses.replace(GREEDY, max_tokens=24)
SEEDED = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=7, ignore_eos=True)
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "n": {"type": "integer"}},
    "required": ["name", "n"],
}
JSON = SamplingParams(
    max_tokens=24, temperature=0, grammar=Grammar("json_schema", json.dumps(SCHEMA))
)
# 64 pages of 4 tokens hold the batch and the prefix workloads; the burst's 8 prompts of 40
# tokens (16 pages each with their output) do not: the scheduler preempts
POOL = ("--num-pages", "64", "--page-size", "4")


@dataclasses.dataclass(frozen=True)
class Family:
    """A target and its drafters' flags by row name; `paths` fills the flags' {placeholders}
    (files the tests write), `vocab` bounds the prompts' token ids."""

    model: tuple[str, ...]
    vocab: int
    drafters: dict[str, tuple[str, ...]]
    grammar: bool = True  # whether its tokenizer spells JSON


SPEC = "--speculative"
DRAFTERS: dict[str, tuple[str, ...]] = {
    "none": (SPEC, "none"),
    "auto": (),
    "draft": (SPEC, "draft"),
    "ngram": (SPEC, "ngram"),
    "suffix": (SPEC, "suffix"),
    "eagle": (SPEC, "eagle"),
    "eagle-fixed": (SPEC, "eagle", "--tree", "fixed"),
    "eagle-dynamic": (SPEC, "eagle", "--tree", "dynamic"),
    "mtp": (SPEC, "mtp"),
    "mtp-1": (SPEC, "mtp", "--num-speculative-tokens", "1"),
    "hybrid": (SPEC, "hybrid"),
}
WITH_FILE = {  # the rows of a family whose drafters are files the tests write
    "draft": ("--draft", "{draft}"),
    "eagle": ("--draft", "{eagle}"),
    "eagle-fixed": ("--draft", "{eagle}"),
    "eagle-dynamic": ("--draft", "{eagle}"),
    "mtp": ("--draft", "{mtp}"),
    "mtp-1": ("--draft", "{mtp}"),
    "hybrid": ("--hybrid-head", "draft", "--draft", "{draft}"),
}
# DeepSeek-V3 targets draft with their own MTP layer, the demo's draft model (the same
# tokenizer) or no model; no EAGLE head fits them (REFUSED)
DEEPSEEK_ROWS = ("none", "auto", "draft", "ngram", "suffix", "mtp", "mtp-1")
FAMILIES = {
    "demo": Family(("--model", "demo"), 4096, DRAFTERS),
    "qwen2": Family(
        ("--model", "{target}"),
        300,
        {name: flags + WITH_FILE.get(name, ()) for name, flags in DRAFTERS.items()},
    ),
    "deepseek": Family(
        ("--model", str(DEEPSEEK)), 4096, {name: DRAFTERS[name] for name in DEEPSEEK_ROWS}
    ),
}
# the fast tier's one row per drafter: float16 (what CUDA users run) on the demo family
FAST = ("demo", "float16")
ROWS = [
    pytest.param(
        family,
        dtype,
        drafter,
        id=f"{family}-{dtype}-{drafter}",
        marks=() if (family, dtype) == FAST else pytest.mark.slow,
    )
    for family, spec in FAMILIES.items()
    for dtype in DTYPES
    for drafter in spec.drafters
    if drafter != "none"
]
# (flags, what the refusal names): combinations that cannot work, refused at start (by the
# flags' check, or by the engine's build, before it serves)
REFUSED = [
    ((SPEC, "eagle", "--tree", "fixed", "--speculative", "draft"), "--speculative eagle or mtp"),
    (("--model", str(DEEPSEEK), SPEC, "eagle"), "--draft"),
    (("--model", str(DEEPSEEK), SPEC, "hybrid"), "--draft"),
]


@pytest.fixture(scope="module")
def paths(tmp_path_factory) -> dict[str, str]:
    files = write_qwen2_pair(tmp_path_factory.mktemp("pair"))
    return {name: str(path) for name, path in files.items()}


def engine_config(family: Family, dtype: str, drafter: str, paths: dict, *more: str):
    argv = [*family.model, *family.drafters[drafter], "--dtype", dtype, *POOL, *more]
    config, _ = config_from_args([flag.format(**paths) for flag in argv])
    return config


def prompts(vocab: int) -> dict[str, list[list[int]]]:
    batch = [p + p[:6] for p in ragged_prompts(4, vocab, seed=5)]  # repeats: n-gram matches
    base = ragged_prompts(1, vocab, seed=6)[0][:10] * 2  # 20 tokens: 5 full pages
    burst = [(p * 40)[:40] for p in ragged_prompts(8, vocab, seed=7)]
    return {"batch": batch, "prefix": [base, base + [3, 4, 5]], "burst": burst}


async def workloads(engine: AsyncEngine, family: Family, graphs: bool) -> dict[str, list]:
    """Each workload's outputs (deltas), one feature at a time; with graphs, the batch only."""
    p = prompts(family.vocab)
    out: dict[str, list] = {}
    out["batch"] = await asyncio.gather(*(engine.generate(x, GREEDY) for x in p["batch"]))
    if graphs:
        return out
    hits = engine.allocator.prefixes.hit
    out["prefix"] = [await engine.generate(x, GREEDY) for x in p["prefix"]]
    assert engine.allocator.prefixes.hit > hits  # the second prompt found the first's pages
    out["seeded"] = [await engine.generate(x, SEEDED) for x in p["batch"][:2]]
    if family.grammar:
        out["json"] = [await engine.generate(p["batch"][0], JSON)]
    preemptions = engine.scheduler.num_preemptions
    out["burst"] = await asyncio.gather(*(engine.generate(x, BURST) for x in p["burst"]))
    assert engine.scheduler.num_preemptions > preemptions
    return out


async def run_row(config, family: Family, graphs: bool = False) -> tuple[dict, int]:
    """The workloads' outputs, and how many steps skipped the drafter's refill (the draft
    model's lazy refill, caught up before it next drafts)."""
    skipped = 0

    def probe(stage: str, plan: Any, dev: Any) -> None:
        nonlocal skipped
        skipped += stage == "draft" and not plan.drafter_refill

    config = dataclasses.replace(config, debug=DebugConfig(fault=probe))
    async with running(config) as engine:
        out = await workloads(engine, family, graphs)
        assert engine.allocator.num_used == 0  # every page is free when no request is live
    return out, skipped


def assert_equal_to_plain(plain: dict, ours: dict, dtype: str, what: str) -> None:
    """Greedy output equals plain decoding's but at a near-tie of plain's top two logits;
    seeded and grammar-constrained output (no logprobs kept) equals it exactly in float32."""
    for name, outs in ours.items():
        errors = [d.error for deltas in outs for d in deltas if d.error]
        assert not errors, (what, name, errors)
        theirs = [token_ids(deltas) for deltas in outs]
        if name in ("seeded", "json"):
            exact = [token_ids(deltas) for deltas in plain[name]]
            assert theirs == exact or dtype != "float32", (what, name)
        else:
            assert_departs_only_at_near_ties(plain[name], theirs, ROUNDING[dtype], f"{what} {name}")


_PLAIN: dict[tuple[str, str], dict] = {}


async def plain_outputs(family: str, dtype: str, paths: dict) -> dict:
    """Plain decoding's outputs of the family at the dtype, made once a session."""
    if (family, dtype) not in _PLAIN:
        config = engine_config(FAMILIES[family], dtype, "none", paths)
        _PLAIN[family, dtype] = (await run_row(config, FAMILIES[family]))[0]
    return _PLAIN[family, dtype]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family, dtype, drafter", ROWS)
async def test_every_combination_equals_plain_decoding(family, dtype, drafter, paths):
    spec = FAMILIES[family]
    plain = await plain_outputs(family, dtype, paths)
    config = engine_config(spec, dtype, drafter, paths)
    assert config.spec.adaptive_k or config.spec.tree != "chain" or config.spec.one_token_mode
    ours, skipped = await run_row(config, spec)
    assert_equal_to_plain(plain, ours, dtype, drafter)
    if family == "demo" and config.spec.drafting_model == "draft":
        assert skipped > 0  # the cost model's k = 0 steps left the draft model's refill out
    graphed, _ = await run_row(
        engine_config(spec, dtype, drafter, paths, "--cuda-graphs", "on"), spec, graphs=True
    )
    assert_equal_to_plain(plain, graphed, dtype, f"{drafter} with --cuda-graphs on")


@pytest.mark.parametrize("flags, named", REFUSED, ids=[" ".join(f) for f, _ in REFUSED])
def test_combinations_that_cannot_work_are_refused_at_start(flags, named, capsys):
    try:
        config, _ = config_from_args(list(flags))
    except SystemExit:
        assert named in capsys.readouterr().err
        return
    with pytest.raises(ValueError, match=named):
        AsyncEngine(config)


@pytest.mark.slow
async def test_float16_with_every_drafter_answers_over_http(paths):
    """What CUDA users run, on the CPU: `--dtype float16` with each drafter, served; every
    completion answered (it was a 500 with the draft model's catch-up)."""
    for drafter in DRAFTERS:
        config = engine_config(FAMILIES["demo"], "float16", drafter, paths)
        async with served(AsyncEngine(config)) as url, aiohttp.ClientSession() as session:
            body = {"prompt": "def add(a, b):", "max_tokens": 24, "temperature": 0}
            async with session.post(url + "/v1/completions", json=body) as response:
                assert response.status == 200, (drafter, await response.text())
                answer = await response.json()
        assert answer["usage"]["completion_tokens"] == 24, drafter
