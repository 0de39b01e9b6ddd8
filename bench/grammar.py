"""Structured output's speed: JSON extraction and forced tool calls (bench/grammar_tasks.json)
at batch 1, greedy, eos honoured, the cost model choosing k.

Methods: `none` (no grammar: the plain baseline), then with each request's grammar: `none`,
`grammar` (no model: the drafts are the tokens the grammar forces and the usual spelling of
the strings it forces), `grammar-forced` (the forced tokens alone: the gain of forcing), the
drafters with grammar-aware drafting (`eagle`, `mtp`, `draft`, `ngram`: n-gram's host drafts
go on with what the grammar implies) or without it (`eagle-unaware`, `mtp-unaware`: drafts
from the head's own q, which the sampler rejects where the grammar forbids them), and
`eagle-dynamic` (a tree, masked in the sampler only). Per method: decode tokens/s (after the
first token), the acceptance length (tokens a decode step), the grammar's host time a step
(masks along drafts, commits, host drafts) and the share of tokens the grammar forced. Methods
each run their engine in a process of their own and take the tasks in turn, `--rounds` times
over (`vs_none`: tokens/s over that with the grammar and no speculation).

    python -m bench.grammar [--model smollm2] [--rounds 2] [--methods M ...] [--out F.json]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import stages.grammar
from bench.common import EngineProcess, answer, write_json
from core.params import Grammar, SamplingParams
from core.step import StepKind
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from stages.sample import SampleStage
from structured import grammar_of

TASKS = Path(__file__).resolve().parent / "grammar_tasks.json"
METHODS = ("none", "grammar", "grammar-forced", "ngram", "draft", "eagle", "eagle-unaware",
           "eagle-dynamic", "mtp", "mtp-unaware")  # fmt: skip


@dataclass(frozen=True)
class Task:
    messages: list[dict[str, str]]
    tools: list[dict[str, Any]] | None
    grammar: Grammar


def load_tasks() -> list[Task]:
    """The committed tasks as chat requests, each with the grammar its fields ask for."""
    spec = json.loads(TASKS.read_text())
    tasks = []
    for t in spec["extraction"]:
        ask = f"Extract the information from this text as JSON.\n\n{t['text']}"
        fields = {
            "response_format": {"type": "json_schema", "json_schema": {"schema": t["schema"]}}
        }
        tasks.append(Task([{"role": "user", "content": ask}], None, grammar_of(fields)[0]))
    tools = [
        {"type": "function", "function": {"name": name, "parameters": parameters}}
        for name, parameters in spec["functions"].items()
    ]
    for t in spec["tools"]:
        choice = {"type": "function", "function": {"name": t["tool"]}}
        grammar = grammar_of({"tools": tools, "tool_choice": choice})[0]
        tasks.append(Task([{"role": "user", "content": t["request"]}], tools, grammar))
    return [t for t in tasks if t.grammar is not None]


def spec_for(method: str, k: int) -> SpecConfig:
    base, _, variant = method.partition("-")
    if base == "none":
        return SpecConfig("none")
    fields: dict[str, Any] = {"method": base, "num_speculative_tokens": k}
    if variant == "unaware":
        fields["grammar_drafting"] = False
    if variant == "forced":
        fields["method"] = "grammar"
    if variant == "dynamic":
        fields["tree"] = "dynamic"
    return SpecConfig(**fields)


@dataclass
class GrammarClock:
    """Host time spent in stages/grammar.py, and the decode steps it was spent over."""

    seconds: float = 0.0
    steps: int = 0
    originals: list[tuple[Any, str, Any]] = field(default_factory=list)

    def __enter__(self) -> GrammarClock:
        walks = [(stages.grammar.GrammarWalk, n) for n in ("chain", "tree", "commit")]
        drafts = [(stages.grammar.DraftWalk, n) for n in ("allowed", "advance", "undo")]
        for owner, name in [*walks, *drafts, (stages.grammar, "host_drafts")]:
            self._wrap(owner, name, self._timed)
        self._wrap(SampleStage, "__call__", self._counted)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in self.originals:
            setattr(owner, name, original)

    def _wrap(self, owner: Any, name: str, wrapper: Callable[[Any], Any]) -> None:
        original = getattr(owner, name)
        self.originals.append((owner, name, original))
        setattr(owner, name, wrapper(original))

    def _timed(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kw: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kw)
            finally:
                self.seconds += time.perf_counter() - start

        return timed

    def _counted(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def counted(stage: Any, plan: Any, *args: Any) -> Any:
            self.steps += plan.kind == StepKind.DECODE
            return fn(stage, plan, *args)

        return counted


@dataclass
class Row:
    method: str
    grammar: bool
    tokens: int = 0
    decode_s: float = 0.0
    steps: int = 0
    grammar_s: float = 0.0
    forced: int = 0
    valid: int = 0
    requests: int = 0

    def add(self, other: Row) -> None:
        for name in ("tokens", "decode_s", "steps", "grammar_s", "forced", "valid", "requests"):
            setattr(self, name, getattr(self, name) + getattr(other, name))

    @property
    def speed(self) -> float:
        return self.tokens / self.decode_s

    def body(self) -> dict[str, Any]:
        return {
            "method": self.method + ("" if self.grammar else " (no grammar)"),
            "tok_s": round(self.speed, 2),
            "acceptance_length": round(self.tokens / max(self.steps, 1), 3),
            "grammar_ms_per_step": round(1e3 * self.grammar_s / max(self.steps, 1), 3),
            "forced_share": round(self.forced / max(self.tokens, 1), 3),
            "valid": f"{self.valid}/{self.requests}",
        }


class Cell:
    """A method's engine in a process of its own (bench/common.py EngineProcess), running one
    task at a time."""

    def __init__(self, model: str, method: str, grammar: bool, args: argparse.Namespace):
        self.row = Row(method, grammar)
        self.max_tokens = args.max_tokens
        kv = KVConfig(page_size=16, num_pages=max(64, 4 * (args.max_tokens // 16 + 40)))
        config = EngineConfig(model, spec_for(method, args.k), kv, max_running=1)
        self.engine = EngineProcess(config)
        if method == "grammar-forced":
            self.engine.run(_forced_only)
        self.engine.run(run_task, 0, True, self.max_tokens)  # warm-up: the cost model, xgrammar

    def run(self, task: int) -> None:
        self.row.add(self.engine.run(run_task, task, self.row.grammar, self.max_tokens))

    def close(self) -> None:
        self.engine.close()


async def run_task(engine: AsyncEngine, task: int, grammar: bool, max_tokens: int) -> Row:
    row = Row("", grammar)
    with GrammarClock() as clock:
        await one(engine, load_tasks()[task], grammar, max_tokens, row)
    row.steps, row.grammar_s = clock.steps, clock.seconds
    return row


async def _forced_only(engine: AsyncEngine) -> None:
    engine.planner.spell = None  # drafts: the tokens the grammar forces, no spelled strings


async def one(engine: AsyncEngine, task: Task, grammar: bool, max_tokens: int, row: Row) -> None:
    prompt = engine.tokenizer.encode_chat(task.messages, **_tools(task))
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0, grammar=task.grammar if grammar else None
    )
    if params.grammar is not None:
        await engine.compile_grammar(params.grammar)
    out = await answer(engine, prompt, params)
    row.tokens += len(out.ids) - 1  # the first token is the prefill's
    row.decode_s += out.decode_s
    row.forced += out.usage.forced_tokens
    row.requests += 1
    row.valid += _parses(out.text)


def _tools(task: Task) -> dict[str, Any]:
    """The chat template's tools argument (a template without a form for them ignores it)."""
    return {"tools": task.tools} if task.tools else {}


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


# ---- the CLI ----


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.grammar", description=__doc__)
    parser.add_argument("--model", default="demo", help="demo, smollm2 or a path")
    parser.add_argument("--methods", nargs="+", default=None, choices=METHODS)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the tasks")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=4, help="the most draft tokens a step")
    parser.add_argument("--out", type=Path, default=None, help="write the rows here (JSON)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    tasks = load_tasks()
    methods = args.methods or [m for m in METHODS if args.model == "demo" or m != "draft"]
    methods = ["none"] + [m for m in methods if m != "none"]  # the baseline, always
    cells = [Cell(args.model, m, True, args) for m in methods]
    cells.insert(0, Cell(args.model, "none", False, args))
    try:  # task by task, each method in turn: the machine's speed drifts over seconds
        for _ in range(args.rounds):
            for task in range(len(tasks)):
                for cell in cells:
                    cell.run(task)
    finally:
        for cell in cells:
            cell.close()
    baseline = next(c.row for c in cells if c.row.method == "none" and c.row.grammar)
    results = []
    for cell in cells:
        body = cell.row.body() | {"vs_none": round(cell.row.speed / baseline.speed, 3)}
        results.append(body)
        print(json.dumps(body), flush=True)
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
