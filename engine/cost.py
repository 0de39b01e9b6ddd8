"""The cost model: each decode step's draft length k, chosen to maximise expected tokens/s.

A step with draft length k over B sequences costs about

    time(B, k) = verify(B * (k + 1)) + max(k, 1) * draft(B) + sample(D (k + 1)) + couple(C (k + 1))

(the drafter's k - 1 chained forwards and its refill, each over B tokens, the refill running
even at k = 0 so that the drafter keeps up; `verify` includes the target's logits); k * draft(B)
for a drafter that skips the refill of a step it drafts nothing in (Drafter.lazy_refill), its
catch-up when it drafts again left out. The last two terms are the sampler's rows: D sampled
requests drawn by the inverse CDF, C by the seeded coupling (core.params.SamplerLoad), each of
k + 1 rows; a greedy row's argmax is small beside its verify. At temperature 1 a row's
distribution and draw cost SmolLM2 6% of a one-row forward, a seeded row's 12% (before the
coupling's native pass, 25%): left out, long drafts of a low acceptance looked nearly free.
The curves are measured at start-up by timing the models' forwards and the sampler at a few
sizes (or loaded from a calibration file) and interpolated; each batch-size bucket keeps
correction factors learned from the steps' measured device time, which bring in what the
forwards alone miss (attention over the context, copies, the draft rows' handling): one for
each k seen, and one for the bucket, which a k not seen yet takes. One factor for every k
mispriced the rows: on SmolLM2 at temperature 1 a second row cost 1.33 ms of device time, the
curves 0.72 ms times the factor of one-row steps (1.26).

Request i, whose drafts are each accepted with probability a_i and which may draft n_i(k) <= k
tokens, emits in expectation (1 - a_i^(n_i + 1)) / (1 - a_i) tokens a step. The chosen k
maximises sum_i E_i / time(B, k) over 0..k_max; k = 0 turns speculation off for the step
(the drafter still refills). a_i is estimated per request from the accepted
counts with exponential forgetting, starting from a prior; a step that drafts nothing fades
the estimate back toward the prior, so that a request the model stopped drafting for is
tried again after a while (acceptance drifts with the text).
"""

from __future__ import annotations

import bisect
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from core.params import SamplerLoad
from core.request import expected_tokens
from models.attention import Attention, CausalAttention
from stages.sample import probe_sampler

log = logging.getLogger("tandem.cost")

# how the curves are measured, and what they time, in the name of the file that keeps them
# between starts: 2, through the paged attention after a warm-up, the sampler's rows with
# them; 3, the coupling's native pass (a seeded row's cost halved)
CALIBRATION_VERSION = 3
GREEDY = SamplerLoad()  # a batch whose rows all take their argmax
FACTOR_SMOOTHING = 0.1  # weight of a new measurement in a correction factor
# saved curves this far from a forward timed at start (and by more than STALE_S) are measured
# again: curves measured on another machine, or while other work ran, would misprice every k
STALE, STALE_S = 2.0, 0.005


@dataclass
class Curve:
    """Seconds of a forward by number of tokens; linear between measured points and beyond."""

    tokens: list[int]  # increasing
    seconds: list[float]

    def __call__(self, n: int) -> float:
        xs, ys = self.tokens, self.seconds
        if len(xs) == 1:
            return ys[0] * n / xs[0]
        i = min(max(bisect.bisect_left(xs, n), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (n - x0) / (x1 - x0))


# Past this many tokens a forward is bound by its arithmetic and grows linearly: the curves
# measure the largest size alone there, once (the two largest forwards were most of a
# 9 s calibration of SmolLM2 at 320 tokens; a server should be healthy within seconds)
LINEAR_FROM = 64
WARM_UP_CALLS, WARM_UP_S = 30, 0.5  # one-token forwards before the curves are measured


def measure_curve(
    forward: Callable[[int], object],
    sizes: list[int],
    repeats: int = 5,
    progress: Callable[[], object] = lambda: None,  # called after each size
) -> Curve:
    """The median of `repeats` timings of `forward(n)` for each n in sizes in turn (after a
    warm-up call; one timing and no warm-up past LINEAR_FROM), made non-decreasing: more
    tokens never cost less. Each size is timed in a run of its own, as a step's forwards
    follow each other: a small model's weights then stay in the caches, which a larger
    forward's buffers (a batch's logits) evict."""
    seconds: list[float] = []
    for n in sizes:
        small = n <= LINEAR_FROM
        if small:
            forward(n)
        times = []
        for _ in range(repeats if small else 1):
            start = time.perf_counter()
            forward(n)
            times.append(time.perf_counter() - start)
        seconds.append(max([statistics.median(times), *seconds[-1:]]))
        progress()
    return Curve(list(sizes), seconds)


def warm_up(forward: Callable[[int], object]) -> None:
    """WARM_UP_CALLS one-token forwards, or as many as WARM_UP_S holds (at least two): the
    first forwards after loading run slower (SmolLM2's one-token forward: 8 ms falling to 4
    over its first twenty); timed then, a curve's first points were half again too high and
    its slope too flat, so that a verified row looked nearly free."""
    start, calls = time.perf_counter(), 0
    while calls < 2 or (calls < WARM_UP_CALLS and time.perf_counter() - start < WARM_UP_S):
        forward(1)
        calls += 1


def calibration_sizes(limit: int) -> list[int]:
    """Where the curves are measured: powers of two up to `limit` and to LINEAR_FROM, and
    `limit` itself."""
    sizes = [1]
    while sizes[-1] * 2 < limit and sizes[-1] < LINEAR_FROM:
        sizes.append(sizes[-1] * 2)
    return sizes + [limit] if limit > 1 else sizes


def _free() -> Curve:
    return Curve([1], [0.0])


@dataclass
class Calibration:
    verify: Curve  # the target's forward and logits over n tokens
    draft: Curve  # one drafter forward over n tokens (zero for a drafter without a model)
    # the sampler over n rows of sampled requests: drawn by the inverse CDF, and by the seeded
    # coupling (its noise included); free where not measured (a test's curves)
    sample: Curve = field(default_factory=_free)
    couple: Curve = field(default_factory=_free)

    def save(self, path: str | Path) -> None:
        """Written whole or not at all (a temporary file renamed), its directory made."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        tmp.replace(path)

    @classmethod
    def read(cls, path: str | Path) -> Calibration | None:
        """The saved curves, or None where the file is missing or unreadable (measure again)."""
        try:
            return cls.load(path)
        except (OSError, ValueError, KeyError, TypeError):
            return None

    @classmethod
    def load(cls, path: str | Path) -> Calibration:
        d = json.loads(Path(path).read_text())
        return cls(*(Curve(**d[name]) for name in ("verify", "draft", "sample", "couple")))


@dataclass
class CostModel:
    calibration: Calibration
    k_max: int
    lazy_refill: bool = False  # a step that drafts nothing runs no drafter forward
    # (batch bucket, k) -> measured / predicted step time, smoothed; (bucket, None): the
    # bucket's over every k, which a k not seen yet takes
    factors: dict[tuple[int, int | None], float] = field(default_factory=dict)

    def forwards_seconds(
        self, batch: int, k: int, drafted: bool = True, load: SamplerLoad = GREEDY
    ) -> float:
        """The step's model forwards and sampled rows, from the curves alone; `drafted` False:
        k drafts that cost no forward (n-gram, suffix), the model's refill skipped where it may
        be; `load`: the batch's sampled requests."""
        cal = self.calibration
        forwards = k if drafted else 0
        if not self.lazy_refill:
            forwards = max(forwards, 1)
        seconds = cal.verify(batch * (k + 1)) + forwards * cal.draft(batch)
        if load.drawn:
            seconds += cal.sample(load.drawn * (k + 1))
        if load.coupled:
            seconds += cal.couple(load.coupled * (k + 1))
        return seconds

    def step_seconds(
        self, batch: int, k: int, drafted: bool = True, load: SamplerLoad = GREEDY
    ) -> float:
        bucket = _bucket(batch)
        factor = self.factors.get((bucket, k), self.factors.get((bucket, None), 1.0))
        return self.forwards_seconds(batch, k, drafted, load) * factor

    def choose(self, rates: list[float], caps: list[int], load: SamplerLoad = GREEDY) -> int:
        """The k in 0..k_max of the most expected tokens per second; caps [B]: each request's
        most drafts (max_tokens, its own num_speculative_tokens)."""
        batch = len(rates)
        best_k, best = 0, 0.0
        for k in range(self.k_max + 1):
            tokens = sum(expected_tokens(r, min(k, c)) for r, c in zip(rates, caps, strict=True))
            speed = tokens / self.step_seconds(batch, k, load=load)
            if speed > best:
                best_k, best = k, speed
        return best_k

    def observe(self, batch: int, k: int, seconds: float, load: SamplerLoad = GREEDY) -> None:
        """A step of `batch` sequences and draft length k took `seconds` of device time."""
        bucket = _bucket(batch)
        ratio = seconds / max(self.forwards_seconds(batch, k, load=load), 1e-9)
        overall = self.factors.get((bucket, None), 1.0)
        for key in ((bucket, k), (bucket, None)):
            old = self.factors.get(key, overall)
            self.factors[key] = (1 - FACTOR_SMOOTHING) * old + FACTOR_SMOOTHING * ratio


def _bucket(batch: int) -> int:
    """Batch sizes grouped by powers of two (1, 2, 3-4, 5-8, ...)."""
    return (batch - 1).bit_length()


def build_cost_model(
    target: Any,
    attention: Callable[[int], Attention],  # a target forward's over n tokens (probe_attention)
    drafter: Any,
    max_rows: int,
    k_max: int,
    path: str | None,
) -> CostModel:
    """The cost model of a target and drafter (`probe(n)`: a drafter forward over n tokens),
    its curves loaded from the calibration file `path` or measured now (a few seconds) and
    saved there."""
    device = target.norm.weight.device

    def verify(num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden, _ = target(ids, ids, attention(num_tokens))
        target.logits(hidden)
        _wait(device)

    def draft(num_tokens: int) -> None:
        drafter.probe(num_tokens)
        _wait(device)

    saved = Calibration.read(path) if path else None
    if saved is not None:
        with torch.inference_mode():
            now = Calibration(measure_curve(verify, [1]), measure_curve(draft, [1]))
        if not stale(saved, now):
            return CostModel(saved, k_max, drafter.lazy_refill)
        log.warning(
            "the cost model's saved curves disagree with a one-token forward now: measuring"
        )
    rows = calibration_sizes(max_rows * (k_max + 1))
    # the sampler is linear in its rows: past LINEAR_FROM the curve extrapolates (its largest
    # probe would hold several copies of a batch's logits)
    sizes = rows, calibration_sizes(max_rows), calibration_sizes(min(rows[-1], LINEAR_FROM))
    log.info("measuring the cost model's curves (a first start's; kept in %s)", path)
    start = time.perf_counter()
    bar = tqdm(
        total=sum(map(len, sizes)) + len(sizes[2]),
        desc="cost model",
        unit="size",
        disable=not sys.stderr.isatty(),  # a log gets the two lines
    )
    with torch.inference_mode(), bar:
        warm_up(verify)
        warm_up(draft)
        calibration = Calibration(
            measure_curve(verify, sizes[0], progress=bar.update),
            measure_curve(draft, sizes[1], progress=bar.update),
            *(measure_curve(run, sizes[2], progress=bar.update) for run in _samplers(target)),
        )
    log.info("measured the cost model's curves in %.1f s", time.perf_counter() - start)
    if path:
        calibration.save(path)
    return CostModel(calibration, k_max, drafter.lazy_refill)


def _samplers(target: Any) -> list[Callable[[int], None]]:
    """The sampler over n rows of the target's logits, drawn by the inverse CDF and by the
    seeded coupling (stages/sample.py: probe_sampler), each waited for."""
    device = target.norm.weight.device
    ids = torch.zeros(1, dtype=torch.long, device=device)
    vocab = target.logits(target(ids, ids, CausalAttention(1, 1))[0]).shape[-1]

    def waited(run: Callable[[int], None]) -> Callable[[int], None]:
        def timed(rows: int) -> None:
            run(rows)
            _wait(device)

        return timed

    return [waited(probe_sampler(vocab, device, seeded)) for seeded in (False, True)]


def stale(saved: Calibration, now: Calibration) -> bool:
    """Whether saved curves were measured on another machine or under load: a one-token
    forward (target or drafter) now more than STALE times faster or slower than they say, and
    by more than STALE_S (a tiny model's or a drafter without a model's never are)."""
    pairs = [(saved.verify(1), now.verify(1)), (saved.draft(1), now.draft(1))]
    return any(max(a, b) > STALE * min(a, b) + STALE_S for a, b in pairs)


def _wait(device: torch.device) -> None:
    """Timing on CUDA: the launched work must have finished."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
