"""The runners of bench.speed, one per method: each runs a cell (method, batch size,
temperature) and returns a Sample of what it cost. EngineRunner drives our AsyncEngine and
reads its step timeline and metrics; HFRunner drives transformers' `generate` at batch 1.
Also the methods' names and the Sample a cell fills, which the CLI and the report share.

An engine cell's step time is the mean wall time of a decode step while the whole group
decodes (from the step timeline). After the cell, on the engine's compute thread, the step's
forwards are timed alone at the cell's shapes and the context length seen (mean prompt plus
half the new tokens). A step's forwards (`step_forwards`), in the order the engine runs them:
its drafting forwards (a chain's k - 1 of one token, the first draft coming from the deferred
logits; a tree's one a level over the nodes it expands, `tree_levels`), the target's verify
forward over the step's width, and the drafter's refill forward over the tokens per sequence it
ran (the step timeline's `drafter_tokens`: the draft model's 1 or 2, an EAGLE or MTP head's
accepted drafts and emitted token).

The step the cell ran most often is timed whole, its forwards back to back in that order, so
that each reads its weights from the cache the forward before it left, as in the engine (the
target's float32 weights do not fit in this CPU's cache and evict the drafter's); each other
step adds its difference from that one, with every forward timed on its own (repeated, so
with its weights cached). Those warm per-forward times are kept too (`verify_s`,
`drafting_s`): they are what the forwards cost with the cache all their own.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import statistics
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench.common import forward_call, median_seconds
from core.params import SamplingParams
from core.request import FinishReason
from engine.config import EngineConfig, SpecConfig
from engine.device import Stream
from engine.engine import AsyncEngine
from stages.draft import NoDrafter

ENGINE_METHODS = ("none", "draft", "ngram", "eagle-chain", "eagle-fixed", "eagle-dynamic",
                  "mtp-1", "mtp-k")  # fmt: skip
HF_METHODS = ("hf-generate", "hf-assisted", "hf-prompt-lookup")
TRACE_KEEP = 1 << 20  # step-timeline records kept in memory (a cell clears them)
FORWARD_REPEATS = 9  # timed calls per forward or step measured alone, per cell and repeat


class MethodUnavailable(RuntimeError):
    """A method that was asked for cannot run as the code stands; the message says why."""


@dataclass
class Sample:
    """One method at one batch size and temperature, one repeat."""

    tokens: int = 0
    seconds: float = 0.0
    ttfts: list[float] = field(default_factory=list)  # per request, seconds
    gaps: list[float] = field(default_factory=list)  # per token after the first, seconds
    steps: list[float] = field(default_factory=list)  # full-batch decode step times, seconds
    widths: list[float] = field(default_factory=list)  # verify tokens per sequence, per step
    refills: list[int] = field(default_factory=list)  # the refill forward's tokens per sequence
    spec_steps: int = 0  # per request, verify steps that speculated (summed)
    draft_tokens: int = 0
    accepted: int = 0
    drafts: float = 0.0  # drafts verified (the engine's metric)
    per_pos: list[float] = field(default_factory=list)  # drafts accepted through position i
    forwards_s: float = math.nan  # a step's forwards alone, in its order (module docstring)
    verify_s: float = math.nan  # the verify forward alone and warm, a step (mean)
    drafting_s: float = 0.0  # a step's drafter forwards alone and warm, the refill's included

    @property
    def step_s(self) -> float:
        """The mean full-batch decode step (NaN without one)."""
        return statistics.fmean(self.steps) if self.steps else math.nan


# ---- our engine ----


class EngineRunner:
    """Runs request groups through one AsyncEngine and reads back what they cost."""

    def __init__(self, method: str, config: EngineConfig, seeded: bool = False, eos: bool = False):
        """seeded: requests carry seeds (sampled ones then draw by the seeded coupling);
        without, the engine seeds them and they take the rejection rule. eos: a request ends
        at the end of its answer (else it runs to max_tokens)."""
        self.method = method
        self.seeded, self.eos = seeded, eos
        try:
            self.engine = AsyncEngine(config)
        except Exception as error:  # a drafter that is not built or not trained fails loudly
            raise MethodUnavailable(f"{method}: {type(error).__name__}: {error}") from error
        self.engine.tracer.keep(TRACE_KEEP)  # the step timeline, in memory
        self.draft_module = drafter_module(method, self.engine.drafter)

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    async def run(
        self, groups: list[list[list[int]]], temperature: float, seed: int, max_tokens: int
    ) -> Sample:
        sample, records = Sample(), self.engine.tracer.records
        assert records is not None
        before = spec_counters(self.engine.metrics.render())
        for group in groups:
            records.clear()
            start = time.perf_counter()
            streams = [
                self.engine.submit(
                    ids,
                    params(temperature, seed + i if self.seeded else None, max_tokens, self.eos),
                )
                for i, ids in enumerate(group)
            ]
            await asyncio.gather(*(self._consume(s, start, sample) for s in streams))
            sample.seconds += time.perf_counter() - start
            steps, widths, refills = decode_steps(list(records), len(group))
            sample.steps += steps
            sample.widths += widths
            sample.refills += refills
        after = spec_counters(self.engine.metrics.render())
        sample.drafts = after[0] - before[0]
        sample.per_pos = [a - b for a, b in zip(after[1], before[1], strict=False)]
        if sample.steps:
            shapes = Counter(zip((round(w) for w in sample.widths), sample.refills, strict=True))
            shape = (len(groups[0]), context_seen(groups, max_tokens))
            forwards = await self._forwards(*shape, shapes)
            sample.forwards_s, sample.verify_s, sample.drafting_s = forwards
        return sample

    async def _consume(self, stream: Any, start: float, sample: Sample) -> None:
        last = None
        async for delta in stream:
            now, n = time.perf_counter(), len(delta.token_ids)
            if delta.finish_reason == FinishReason.ERROR:
                raise RuntimeError(f"{self.method}: a request failed: {delta.error}")
            if n and last is None:
                sample.ttfts.append(now - start)
            elif n:
                sample.gaps += [(now - last) / n] * n
            last = now if n else last
            if delta.usage is not None:
                u = delta.usage
                sample.tokens += u.completion_tokens
                sample.spec_steps += u.spec_steps
                sample.draft_tokens += u.draft_tokens
                sample.accepted += u.accepted_tokens

    async def _forwards(
        self, batch: int, context: int, shapes: Counter[tuple[int, int]]
    ) -> tuple[float, float, float]:
        """Seconds a step (mean over the steps) of its forwards alone in its order, of its
        verify forward alone and warm, and of its drafter forwards alone and warm; `shapes`
        counts the steps by (verify width, refill tokens) a sequence. Timed on the engine's
        compute stream, the thread that runs them in the engine."""
        levels = tree_levels(self.engine.config.spec)
        vocab, module = self.engine.vocab_size, self.draft_module

        def timed_alone() -> tuple[float, float, float]:
            calls: dict[tuple[str, int], Callable[[], object]] = {}
            for width, refill in shapes:
                for kind, n in step_forwards(width, refill, levels):
                    model = self.engine.model if kind == "verify" else module
                    if model is not None and n and (kind, n) not in calls:
                        last_logits = kind == "refill"  # a refill keeps the last token's
                        calls[kind, n] = forward_call(model, vocab, batch, context, n, last_logits)
            warm = {f: median_seconds(call, FORWARD_REPEATS) for f, call in calls.items()}

            def alone(shape: tuple[int, int], kinds: tuple[str, ...] = KINDS) -> float:
                forwards = step_forwards(*shape, levels)
                return sum(warm.get(f, 0.0) for f in forwards if f[0] in kinds)

            def mean(seconds: Callable[[tuple[int, int]], float]) -> float:
                return sum(n * seconds(s) for s, n in shapes.items()) / shapes.total()

            common = shapes.most_common(1)[0][0]
            in_order = [calls[f] for f in step_forwards(*common, levels) if f in calls]
            step = median_seconds(lambda: [call() for call in in_order], FORWARD_REPEATS)
            forwards = step + mean(alone) - alone(common)
            verify = mean(lambda s: alone(s, ("verify",)))
            return forwards, verify, mean(lambda s: alone(s, ("draft", "refill")))

        return await asyncio.wrap_future(self.engine.executor.compute.submit(timed_alone).future)


KINDS = ("draft", "verify", "refill")  # a step's forwards, in the engine's order


def step_forwards(width: int, refill: int, levels: list[int] | None) -> list[tuple[str, int]]:
    """A decode step's forwards in the engine's order, as (kind, tokens per sequence): the
    drafting forwards (a chain's k - 1 = width - 2 of one token, a tree's levels; none for a
    step that drafted nothing), the verify forward, the refill's."""
    drafting = (levels if levels is not None else [1] * (width - 2)) if width > 1 else []
    return [*(("draft", n) for n in drafting), ("verify", width), ("refill", refill)]


def tree_levels(spec: SpecConfig) -> list[int] | None:
    """Tokens a sequence of each drafting forward of a tree step, the refill's aside (None
    for a chain, which drafts with k - 1 forwards of one token). A tree's first level comes
    from the deferred logits; a fixed tree runs the head over the nodes of each depth that
    have children, a dynamic tree over top-k nodes a level."""
    if spec.tree == "fixed":
        inner = {path[:-1] for path in spec.tree_paths if len(path) > 1}
        depth = max(len(path) for path in spec.tree_paths)
        return [sum(len(node) == d for node in inner) for d in range(1, depth)]
    if spec.tree == "dynamic":
        return [spec.tree_topk] * (spec.tree_depth - 1)
    return None


def params(temperature: float, seed: int | None, max_tokens: int, eos: bool) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=not eos
    )


def context_seen(groups: list[list[list[int]]], max_tokens: int) -> int:
    """The mean context length over a cell: mean prompt plus half the new tokens."""
    lengths = [len(ids) for group in groups for ids in group]
    return round(statistics.fmean(lengths) + max_tokens / 2)


def drafter_module(method: str, drafter: Any) -> torch.nn.Module | None:
    """The model a drafter runs (None for drafters that run none); resolved before measuring
    so that a drafter this benchmark cannot time fails at once."""
    if isinstance(drafter, NoDrafter):
        return None
    for name in ("model", "head"):
        module = getattr(drafter, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    raise MethodUnavailable(
        f"{method}: cannot time the {type(drafter).__name__}'s forward alone "
        "(it has no `model` or `head` module)"
    )


def spec_counters(metrics_text: str) -> tuple[float, list[float]]:
    """(drafts verified, per position the drafts accepted through it) from /metrics text."""
    drafts = re.search(r"^tandem_spec_decode_num_drafts_total (\S+)$", metrics_text, re.M)
    found = re.findall(
        r'^tandem_spec_decode_num_accepted_tokens_per_pos_total\{position="(\d+)"\} (\S+)$',
        metrics_text,
        re.M,
    )
    per_pos = [float(v) for _, v in sorted(found, key=lambda pv: int(pv[0]))]
    return (float(drafts.group(1)) if drafts else 0.0), per_pos


def decode_steps(records: list[dict], batch: int) -> tuple[list[float], list[float], list[int]]:
    """From a step timeline: the wall time of each decode step that follows another decode
    step of the whole batch (end of refill to end of refill), and each such step's verify
    tokens and refill forward's tokens, a sequence."""
    plans = {r["step"]: r for r in records if r["stage"] == "plan"}
    refills = {r["step"]: r for r in records if r["stage"] == "refill"}
    full = {s for s, p in plans.items() if p["kind"] == "decode" and p["batch_size"] == batch}
    chosen = sorted(s for s in full & set(refills) if s - 1 in full and s - 1 in refills)
    steps = [refills[s]["end"] - refills[s - 1]["end"] for s in chosen]
    widths = [plans[s]["num_tokens"] / batch for s in chosen]
    return steps, widths, [refills[s]["drafter_tokens"] for s in chosen]


# ---- transformers ----


class HFRunner:
    """transformers' `generate` at batch 1: plain, assisted by the draft model, or prompt
    lookup; k tokens proposed a step, float32. It runs on the thread that runs the engines'
    forwards (a CPU stream: engine/device.py)."""

    def __init__(
        self, method: str, target: Any, assistant: Any, k: int, eos: int, stop: bool = False
    ):
        """eos: the end-of-sequence id; stop: whether a generation ends there."""
        self.method, self.target, self.assistant = method, target, assistant
        self.k, self.eos, self.ends_at_eos = k, eos, stop
        self.forwards = 0  # the target's forward calls in the current generate
        target.register_forward_hook(self._count)
        self.stream = Stream(torch.device("cpu"), "hf")

    def _count(self, *_: Any) -> None:
        self.forwards += 1

    async def start(self) -> None:
        pass  # nothing to start: the models are loaded; kept for the runners' common shape

    async def stop(self) -> None:
        self.stream.close()

    async def run(
        self, groups: list[list[list[int]]], temperature: float, seed: int, max_tokens: int
    ) -> Sample:
        sample = Sample()
        for i, (ids,) in enumerate(groups):
            await self.stream.submit(self._generate, ids, temperature, seed + i, max_tokens, sample)
        return sample

    def _generate(
        self, ids: list[int], temperature: float, seed: int, max_tokens: int, sample: Sample
    ) -> None:
        torch.manual_seed(seed)
        self.forwards, streamer = 0, TimingStreamer()
        start = time.perf_counter()
        with torch.no_grad():
            out = self.target.generate(
                torch.tensor([ids]), streamer=streamer, **self.kwargs(temperature, max_tokens)
            )
        sample.seconds += time.perf_counter() - start
        new = out.shape[1] - len(ids)
        sample.tokens += new
        sample.ttfts.append(streamer.times[0] - start)
        sample.gaps += streamer.gaps()
        if self.method != "hf-generate":  # every forward after the prefill verifies
            sample.spec_steps += self.forwards - 1
            sample.accepted += new - self.forwards

    def kwargs(self, temperature: float, max_tokens: int) -> dict[str, Any]:
        kw: dict[str, Any] = dict(max_new_tokens=max_tokens, pad_token_id=self.eos)
        if not self.ends_at_eos:
            kw["min_new_tokens"] = max_tokens
        kw |= (
            dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            if temperature
            else {"do_sample": False}
        )
        if self.method == "hf-assisted":
            kw["assistant_model"] = self.assistant
        elif self.method == "hf-prompt-lookup":
            kw["prompt_lookup_num_tokens"] = self.k
        return kw


class TimingStreamer:
    """A transformers streamer that records when each chunk of new tokens arrives."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.counts: list[int] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())
        self.counts.append(value.numel())

    def end(self) -> None:
        pass  # part of the streamer interface; the last chunk was recorded by put

    def gaps(self) -> list[float]:
        pairs = zip(self.times, self.times[1:], self.counts[1:], strict=False)
        return [(b - a) / n for a, b, n in pairs for _ in range(n)]


def hf_models(target: Path, draft: Path, k: int) -> tuple[Any, Any]:
    """The target and the draft model in transformers, float32; the draft set up to propose
    exactly k tokens a step (constant schedule, no confidence cut-off)."""
    import transformers

    transformers.logging.set_verbosity_error()  # deprecation notices about generate's arguments
    load = transformers.AutoModelForCausalLM.from_pretrained
    target_model = load(target, dtype=torch.float32).eval()
    assistant = load(draft, dtype=torch.float32).eval()
    gen = assistant.generation_config
    gen.num_assistant_tokens, gen.num_assistant_tokens_schedule = k, "constant"
    gen.assistant_confidence_threshold = 0.0
    return target_model, assistant


def eos_id(target: Path) -> int:
    """The target's end-of-sequence id (its first, if it lists several), as generate's pad."""
    config = json.loads((target / "config.json").read_text())
    eos = config.get("eos_token_id", 0)
    return eos[0] if isinstance(eos, list) else int(eos or 0)


Runner = EngineRunner | HFRunner  # what bench.speed drives: method, start, run, stop
