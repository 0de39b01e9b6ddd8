"""The engine's metrics, through `prometheus-client`, rendered in the Prometheus text format
for GET /metrics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from core.request import FinishReason

# a `_created` timestamp beside every counter and histogram doubles the text for no reader here
prometheus_client.disable_created_metrics()


class Registry:
    """An engine's own collector registry, with its families made through it."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)

    def counter(self, name: str, help: str, labels: Sequence[str] = ()) -> Counter:
        return Counter(name, help, labels, registry=self.registry)

    def gauge(self, name: str, help: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(name, help, labels, registry=self.registry)

    def histogram(self, name: str, help: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(name, help, buckets=buckets, registry=self.registry)

    def render(self) -> str:
        """The exposition text, served as `text/plain; version=0.0.4`."""
        return prometheus_client.generate_latest(self.registry).decode()

    def value(self, name: str, **labels: object) -> float:
        """A sample's value (0 where it has none yet)."""
        found = self.registry.get_sample_value(name, {k: str(v) for k, v in labels.items()})
        return found or 0.0


# first-token latency spans queueing and prefill, so its buckets reach further
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1,
                0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)  # fmt: skip


class EngineMetrics:
    """The metrics DESIGN.md promises, with the calls the engine makes; `render()` is what
    GET /metrics serves."""

    def __init__(self, num_speculative_tokens: int = 0) -> None:
        r = self.registry = Registry()  # an engine's own: tests run several engines at once
        # sets the gauges that describe a state (requests, pages) just before each render,
        # rather than at every change of it
        self.collect: Callable[[], None] | None = None
        self.requests_running = r.gauge("tandem_requests_running", "Requests being served.")
        self.requests_waiting = r.gauge("tandem_requests_waiting", "Requests waiting to start.")
        self.kv_pages_used = r.gauge("tandem_kv_pages_used", "KV pages held by requests.")
        self.kv_pages_free = r.gauge("tandem_kv_pages_free", "KV pages free.")
        self.kv_pages_total = r.gauge("tandem_kv_pages_total", "KV pages in the pool.")
        self.prefix_cache_pages = r.gauge(
            "tandem_prefix_cache_pages", "KV pages holding a cached prefix (in use or idle)."
        )
        self.prefix_cache_hit_rate = r.gauge(
            "tandem_prefix_cache_hit_rate", "Share of admitted prompt tokens found cached."
        )
        self.memory_bytes = r.gauge(
            "tandem_memory_bytes",
            "Bytes held: the weights, the KV cache (target and drafter).",
            ["kind"],
        )
        self.products = r.gauge(
            "tandem_products",
            "1 for how the target's linears are multiplied (quantized/<kernel path>, a dtype).",
            ["products"],
        )
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
        self.drafter_tokens = r.counter(
            "tandem_spec_decode_drafter_tokens_total",
            "--speculative auto: draft tokens proposed and accepted, by the drafter that "
            "proposed them (model, ngram, suffix)",
            ["drafter", "kind"],
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

    def set_prefix_cache(self, pages: int, hit_rate: float) -> None:
        self.prefix_cache_pages.set(pages)
        self.prefix_cache_hit_rate.set(hit_rate)

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

    def observe_drafter(self, drafter: str | None, drafted: int, accepted: int) -> None:
        """A request's drafts of a step by the drafter a policy chose (None: no policy)."""
        if drafter:
            self.drafter_tokens.labels(drafter=drafter, kind="proposed").inc(drafted)
            self.drafter_tokens.labels(drafter=drafter, kind="accepted").inc(accepted)

    def render(self) -> str:
        if self.collect is not None:
            self.collect()
        return self.registry.render()


class Merged:
    """Several engines' exposition texts as one registry's collector: each sample labelled
    with its engine (`label="<key>"`), each family once (engine replicas, engine/replicas.py)."""

    def __init__(self, texts: Mapping[str, str], label: str, extra: Iterable[Metric] = ()):
        self.families: dict[str, Metric] = {}
        for key, text in texts.items():
            for family in text_string_to_metric_families(text):
                samples = [s._replace(labels=s.labels | {label: key}) for s in family.samples]
                merged = self.families.setdefault(family.name, family)
                merged.samples = (merged.samples if merged is not family else []) + samples
        self.families |= {family.name: family for family in extra}

    def collect(self) -> list[Metric]:
        return list(self.families.values())

    def render(self) -> str:
        registry = CollectorRegistry(auto_describe=False)
        registry.register(self)
        return prometheus_client.generate_latest(registry).decode()
