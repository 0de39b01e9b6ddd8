"""bench.agentic's fixed requests and its measure of copying, and an engine in a process of
its own (bench/common.py EngineProcess) as the benchmarks run them."""

from __future__ import annotations

import json

from bench.agentic import (
    COPY_RUN,
    EDITS,
    chat_openings,
    copied,
    echo_prompts,
    edit_prompts,
    questions,
)
from bench.common import EngineProcess
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine


def test_the_requests_are_fixed_by_the_script():
    prompts = edit_prompts()
    assert len(prompts) == len(EDITS) == 6
    for prompt, (_, _, old, new) in zip(prompts, EDITS, strict=True):
        assert f"`{old}` to `{new}`" in prompt and prompt.count(old) > 2
    assert edit_prompts() == prompts and len(chat_openings(3)) == 3
    assert echo_prompts() == echo_prompts() and len(echo_prompts()) == 6
    assert len(questions()) >= 12  # enough for 3 chats of 5 turns


def test_copied_counts_answer_tokens_inside_runs_found_in_the_prompt():
    prompt = list(range(100))
    run = list(range(10, 10 + COPY_RUN))
    assert copied(prompt, run) == COPY_RUN
    assert copied(prompt, [500] + run + [501] + run[:-1]) == COPY_RUN  # a short run is not
    assert copied(prompt, list(range(20, 30))) == 10  # overlapping runs cover each token once
    assert copied(prompt, [7] * 20) == 0


async def _answer(engine: AsyncEngine, prompt: list[int]) -> list[int]:
    from core.params import SamplingParams

    deltas = await engine.generate(prompt, SamplingParams(max_tokens=4, temperature=0))
    return [t for d in deltas for t in d.token_ids]


def test_an_engine_process_runs_jobs_on_its_engine(tiny_target):
    config = EngineConfig(
        str(tiny_target), SpecConfig("none"), kv=KVConfig(page_size=4, num_pages=64)
    )
    cell = EngineProcess(config)
    try:
        first = cell.run(_answer, [1, 2, 3])
        assert len(first) == 4 and cell.run(_answer, [1, 2, 3]) == first
    finally:
        cell.close()


def test_the_turns_workload_serves_each_history_with_every_method(tmp_path):
    from bench.agentic import main

    out = tmp_path / "rows.json"
    # at a fixed k, so that suffix decoding drafts whatever a busy machine's cost model prices
    args = ["--workload", "turns", "--model", "demo", "--chats", "1", "--turns", "2", "--fixed-k"]
    assert main([*args, "--methods", "none", "suffix", "--max-tokens", "6", "--out", str(out)]) == 0
    rows = {row["method"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"none", "suffix"} and rows["none"]["vs_none"] == 1.0
    assert rows["suffix"]["tokens_per_spec_step"] >= 1 and rows["none"]["ttft_mean_s"] > 0
