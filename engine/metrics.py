"""Counters, gauges and histograms with labels, rendered in the Prometheus text format (0.0.4),
and the engine's own metrics on top of them. No third-party dependency."""

from __future__ import annotations

import bisect
import math
import re
import threading
from collections.abc import Callable, Sequence
from typing import Any

from engine.request import FinishReason

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*\Z")
_LABEL = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*\Z")


def _format_value(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return "NaN" if math.isnan(value) else repr(float(value))


def _escape_label(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: Sequence[str], values: Sequence[str]) -> str:
    if not names:
        return ""
    pairs = ",".join(f'{n}="{_escape_label(v)}"' for n, v in zip(names, values, strict=True))
    return "{" + pairs + "}"


class _Metric:
    """One metric family: a name, a help line, label names, and a child per label values."""

    kind = ""

    def __init__(self, name: str, help: str, labels: Sequence[str] = ()) -> None:
        if not _NAME.match(name):
            raise ValueError(f"bad metric name {name!r}")
        for label in labels:
            if not _LABEL.match(label) or label.startswith("__") or label == "le":
                raise ValueError(f"bad label name {label!r} for {name}")
        self.name, self.help, self.label_names = name, help, tuple(labels)
        self._lock = threading.Lock()  # the engine loop writes while the server renders
        self._children: dict[tuple[str, ...], list[float]] = {}
        self._views: dict[tuple[str, ...], object] = {}  # label values -> the child handed out
        if not labels:
            self._child(())

    def _new_values(self) -> list[float]:
        return [0.0]

    def _key(self, labels: dict[str, object]) -> tuple[str, ...]:
        if len(labels) != len(self.label_names) or not all(n in labels for n in self.label_names):
            raise ValueError(f"{self.name} takes labels {self.label_names}, got {tuple(labels)}")
        return tuple([str(labels[n]) for n in self.label_names])

    def _view(self, labels: dict[str, object], make: type) -> Any:
        """The child object for these labels, made once (the engine updates some every step)."""
        key = self._key(labels)
        view = self._views.get(key)
        if view is None:
            view = self._views[key] = make(self, self._child(key))
        return view

    def _child(self, key: tuple[str, ...]) -> list[float]:
        with self._lock:
            return self._children.setdefault(key, self._new_values())

    def render(self) -> list[str]:
        help = self.help.replace("\\", "\\\\").replace("\n", "\\n")
        lines = [f"# HELP {self.name} {help}", f"# TYPE {self.name} {self.kind}"]
        with self._lock:
            children = [(key, list(values)) for key, values in self._children.items()]
        for key, values in children:
            lines += self._samples(_label_text(self.label_names, key), key, values)
        return lines

    def _samples(self, labels: str, key: tuple[str, ...], values: list[float]) -> list[str]:
        return [f"{self.name}{labels} {_format_value(values[0])}"]


class Counter(_Metric):
    """A value that only goes up. `inc()` without labels, `labels(...).inc()` with them."""

    kind = "counter"

    def labels(self, **labels: object) -> _CounterChild:
        return self._view(labels, _CounterChild)

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)


class _CounterChild:
    def __init__(self, metric: _Metric, values: list[float]) -> None:
        self._metric, self._values = metric, values

    def inc(self, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"{self._metric.name}: a counter cannot decrease")
        with self._metric._lock:
            self._values[0] += amount

    @property
    def value(self) -> float:
        return self._values[0]


class Gauge(_Metric):
    """A value that is set, or goes up and down."""

    kind = "gauge"

    def labels(self, **labels: object) -> _GaugeChild:
        return self._view(labels, _GaugeChild)

    def set(self, value: float) -> None:
        self.labels().set(value)

    def inc(self, amount: float = 1.0) -> None:
        self.labels().inc(amount)


class _GaugeChild:
    def __init__(self, metric: _Metric, values: list[float]) -> None:
        self._metric, self._values = metric, values

    def set(self, value: float) -> None:
        with self._metric._lock:
            self._values[0] = float(value)

    def inc(self, amount: float = 1.0) -> None:
        with self._metric._lock:
            self._values[0] += amount


class Histogram(_Metric):
    """Observations counted into buckets (upper bounds, inclusive), plus their sum and count.

    Stored per bucket, rendered cumulative with a final `le="+Inf"` bucket."""

    kind = "histogram"

    def __init__(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> None:
        bounds = [float(b) for b in buckets if not math.isinf(b)]
        if not bounds or bounds != sorted(set(bounds)):
            raise ValueError(f"{name}: buckets must be increasing, got {list(buckets)}")
        self.bounds = bounds
        super().__init__(name, help, labels)

    def _new_values(self) -> list[float]:
        return [0.0] * (len(self.bounds) + 3)  # one per bound, +Inf, then sum and count

    def labels(self, **labels: object) -> _HistogramChild:
        return self._view(labels, _HistogramChild)

    def observe(self, value: float) -> None:
        self.labels().observe(value)

    def _samples(self, labels: str, key: tuple[str, ...], values: list[float]) -> list[str]:
        lines, total = [], 0.0
        for bound, count in zip([*self.bounds, math.inf], values[:-2], strict=True):
            total += count
            le = _label_text((*self.label_names, "le"), (*key, _format_value(bound)))
            lines.append(f"{self.name}_bucket{le} {_format_value(total)}")
        lines.append(f"{self.name}_sum{labels} {_format_value(values[-2])}")
        lines.append(f"{self.name}_count{labels} {_format_value(values[-1])}")
        return lines


class _HistogramChild:
    def __init__(self, metric: Histogram, values: list[float]) -> None:
        self._metric, self._values = metric, values

    def observe(self, value: float) -> None:
        index = bisect.bisect_left(self._metric.bounds, value)  # le: bound >= value
        with self._metric._lock:
            self._values[index] += 1
            self._values[-2] += value
            self._values[-1] += 1


class Registry:
    """Metric families by name, rendered in the order they were made."""

    def __init__(self) -> None:
        self._metrics: dict[str, _Metric] = {}

    def _add(self, metric: _Metric) -> None:
        if metric.name in self._metrics:
            raise ValueError(f"metric {metric.name} already registered")
        self._metrics[metric.name] = metric

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        metric = Counter(name, help, labels)
        self._add(metric)
        return metric

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        metric = Gauge(name, help, labels)
        self._add(metric)
        return metric

    def histogram(
        self, name: str, help: str, buckets: Sequence[float], labels: Sequence[str] = ()
    ) -> Histogram:
        metric = Histogram(name, help, buckets, labels)
        self._add(metric)
        return metric

    def render(self) -> str:
        """The exposition text, served as `text/plain; version=0.0.4`."""
        return "".join(line + "\n" for m in self._metrics.values() for line in m.render())


# first-token latency spans queueing and prefill, so its buckets reach further
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip


class EngineMetrics:
    """The metrics DESIGN.md promises, with the calls the engine makes; `render()` is what
    GET /metrics serves."""

    def __init__(self, num_speculative_tokens: int = 0) -> None:
        r = self.registry = Registry()
        # sets the gauges that describe a state (requests, pages) just before each render,
        # rather than at every change of it
        self.collect: Callable[[], None] | None = None
        self.requests_running = r.gauge("tandem_requests_running", "Requests being served.")
        self.requests_waiting = r.gauge("tandem_requests_waiting", "Requests waiting to start.")
        self.kv_pages_used = r.gauge("tandem_kv_pages_used", "KV pages held by requests.")
        self.kv_pages_free = r.gauge("tandem_kv_pages_free", "KV pages free.")
        self.kv_pages_total = r.gauge("tandem_kv_pages_total", "KV pages in the pool.")
        self.prompt_tokens = r.counter("tandem_prompt_tokens_total", "Prompt tokens prefilled.")
        self.generation_tokens = r.counter("tandem_generation_tokens_total", "Tokens generated.")
        self.requests_finished = r.counter(
            "tandem_requests_finished_total", "Requests finished, by reason.", ["reason"]
        )
        self.num_drafts = r.counter(
            "tandem_spec_decode_num_drafts_total", "Drafts verified (one per request a step)."
        )
        self.num_draft_tokens = r.counter(
            "tandem_spec_decode_num_draft_tokens_total", "Draft tokens proposed."
        )
        self.num_accepted_tokens = r.counter(
            "tandem_spec_decode_num_accepted_tokens_total", "Draft tokens accepted."
        )
        self.accepted_per_pos = r.counter(
            "tandem_spec_decode_num_accepted_tokens_per_pos_total",
            "Drafts whose tokens 0..position were all accepted.",
            ["position"],
        )
        self.num_speculative_tokens = r.gauge(
            "tandem_spec_num_speculative_tokens", "Draft length k chosen for the last step."
        )
        self.steps_by_k = r.counter(
            "tandem_spec_decode_steps_total", "Decode steps, by the draft length k chosen.", ["k"]
        )
        self.ttft = r.histogram(
            "tandem_time_to_first_token_seconds", "Arrival to first token.", TTFT_BUCKETS
        )
        self.inter_token = r.histogram(
            "tandem_inter_token_latency_seconds", "Time between a request's outputs.", STEP_BUCKETS
        )
        self.step = r.histogram("tandem_step_seconds", "Engine step duration.", STEP_BUCKETS)
        self.world_size = r.gauge(
            "tandem_tensor_parallel_size", "Ranks the target is split over (1: one process)."
        )
        self.world_size.set(1)
        self.rank_bytes = r.gauge(
            "tandem_tensor_parallel_bytes",
            "Bytes the leader rank has sent through each collective.",
            ["rank", "collective"],
        )
        for reason in FinishReason:  # every reason shows, at 0 until it happens
            self.requests_finished.labels(reason=reason.value)
        for position in range(num_speculative_tokens):
            self.accepted_per_pos.labels(position=position)

    def set_requests(self, running: int, waiting: int) -> None:
        self.requests_running.set(running)
        self.requests_waiting.set(waiting)

    def set_kv_pages(self, used: int, total: int) -> None:
        self.kv_pages_used.set(used)
        self.kv_pages_free.set(total - used)
        self.kv_pages_total.set(total)

    def add_tokens(self, prompt: int = 0, generated: int = 0) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)

    def finish(self, reason: FinishReason | str) -> None:
        self.requests_finished.labels(reason=FinishReason(reason).value).inc()

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_inter_token(self, seconds: float) -> None:
        self.inter_token.observe(seconds)

    def observe_step(self, seconds: float, k: int | None = None) -> None:
        """One engine step took `seconds`; k: the draft length of a decode step."""
        self.step.observe(seconds)
        if k is not None:
            self.num_speculative_tokens.set(k)
            self.steps_by_k.labels(k=k).inc()

    def observe_spec(self, num_drafts: list[int], accepted: list[int]) -> None:
        """One verify step: per request, its draft length and how many drafts were accepted.

        Requests with no draft tokens are not drafts. Position i counts the drafts whose
        first i+1 tokens were all accepted."""
        for k, a in zip(num_drafts, accepted, strict=True):
            if not 0 <= a <= k:
                raise ValueError(f"accepted {a} of {k} draft tokens")
            if k == 0:
                continue
            self.num_drafts.inc()
            self.num_draft_tokens.inc(k)
            self.num_accepted_tokens.inc(a)
            for position in range(a):
                self.accepted_per_pos.labels(position=position).inc()

    def render(self) -> str:
        if self.collect is not None:
            self.collect()
        return self.registry.render()
