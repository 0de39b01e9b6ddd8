"""AsyncEngine: submit/abort/stream, and the step pipeline that serves them.

A step runs plan -> draft -> verify -> sample -> refill -> publish. Plan runs on the event
loop and hands the step's device stages to the compute stream, in order, then passes the step
to publish through an asyncio queue; publish waits (without blocking the loop) for the step's
tokens to reach the host. The plan of step N+1 needs only step N's accepted lengths
(speculative decoding) or nothing of step N at all (plain decoding, which assumes every
sequence grows by one, and MTP's one-token mode, which assumes no draft was accepted and lets
the device correct that), so it runs while the device still works on step N. The draft
length of each step is the cost model's choice (engine/cost.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import operator
import sys
import time
from collections.abc import AsyncIterator, Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from engine.config import EngineConfig
from engine.cost import build_cost_model
from engine.device import Event, Stream, run_on_device
from engine.metrics import EngineMetrics
from engine.output import OutputStream
from engine.request import (
    Delta,
    EngineFailed,
    FinishReason,
    InvalidRequest,
    Overloaded,
    Request,
    SamplingParams,
    TokenLogprob,
)
from engine.scheduler import Batch, Scheduler, Sequence
from engine.trace import Tracer
from kv.cache import KVCache
from kv.pages import PageAllocator
from models.gguf import packaged_smollm2
from models.llama import prepare_for_inference
from models.loader import load_model
from models.tokenizer import Tokenizer
from stages.draft import Drafter, Drafts
from stages.drafters import build_drafter
from stages.history import TokenHistory
from stages.insert import insert_kernel
from stages.plan import HostBuffers, Plan, draft_cap, make_plan, pack, unpack
from stages.refill import RefillStage
from stages.sample import SamplingTensors
from stages.verdict import SampleStage
from stages.verify import Verifier

log = logging.getLogger("tandem.engine")

DEMO_DIR = Path(__file__).resolve().parent.parent / "models" / "demo"
SMOLLM2 = "smollm2"  # EngineConfig.model naming SmolLM2-135M-Instruct's registry package
MODEL_NAMES = {None: "tandem-demo", SMOLLM2: "SmolLM2-135M-Instruct"}


def model_path(model: str | None) -> Path:
    """A model's directory or GGUF file: the tiny demo family's target (None),
    SmolLM2-135M-Instruct from its registry package ("smollm2"), or the path given."""
    if model is None:
        return DEMO_DIR / "target"
    if model == SMOLLM2:
        return packaged_smollm2()
    return Path(model)


# How long a thread may hold the GIL while another waits for it. The compute thread re-takes
# the GIL after every torch call (hundreds a step, microseconds each); at Python's default of
# 5 ms, each time the event loop runs Python meanwhile, the device work can stall for up to
# that long. In three paired runs of the demo on a 2-core CPU, 0.2 ms was 15% faster twice and
# 7% slower once: that machine's run-to-run noise is as large, so the gain is not established.
SWITCH_INTERVAL_S = 2e-4


class RequestStream:
    """Async iterator of a request's deltas; closing it early aborts the request."""

    def __init__(self, engine: AsyncEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> AsyncIterator[Delta]:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        delta = await self.queue.get()
        self.done = delta.finish_reason is not None
        return delta

    async def aclose(self) -> None:
        if not self.done:
            self.engine.abort(self.request_id)
            self.done = True


class AsyncEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        run_on_device(self.device, self._build)
        self.metrics = EngineMetrics(self.k)
        self.metrics.collect = self._update_gauges  # gauges are read when rendered
        self.tracer = Tracer(config.trace_file)
        self.outputs: dict[str, OutputStream] = {}
        self.streams: dict[str, RequestStream] = {}
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []
        self._fault: Callable[[str, Plan], None] | None = None  # tests inject stage failures
        # supervision: the cause once the engine cannot serve any more, and its signal
        self.failure: str | None = None
        self.failed = asyncio.Event()
        self._failed_steps = 0  # consecutive steps that failed (the circuit breaker's count)

    def _build(self) -> None:
        """Models, caches, stages and the cost model's calibration (on the device's thread)."""
        config = self.config
        dtype = getattr(torch, config.dtype)
        model_dir = model_path(config.model)
        self.model = load_model(model_dir, dtype, self.device)
        prepare_for_inference(self.model)
        self.tokenizer = Tokenizer(model_dir)
        self.model_name = MODEL_NAMES.get(config.model, model_dir.stem)
        cfg = self.model.config
        self.vocab_size = cfg.vocab_size
        self.max_model_len = config.max_model_len or cfg.max_position_embeddings
        spec = config.spec
        self.k = spec.num_draft_tokens if spec.enabled else 0
        self.no_sync = spec.one_token_mode
        self.insert = insert_kernel(self.device)
        page_size = config.kv.page_size
        num_pages = config.kv.num_pages or self._pages_for(config.kv.memory_bytes, dtype)
        self.allocator = PageAllocator(num_pages)
        self.cache = self._new_cache(self.model, num_pages, dtype)
        self.history = TokenHistory(
            config.max_running, self.max_model_len + 2 * self.k + 4, self.device
        )
        self.drafter: Drafter = build_drafter(spec, self, DEMO_DIR)
        self.verifier = Verifier(self.model, self.cache, self.history)
        self.sampler = SampleStage(self.history, self.vocab_size)
        self.refiller = RefillStage(self.history, self.drafter)
        self.scheduler = Scheduler(
            self.allocator,
            page_size,
            config.max_running,
            config.max_batch_tokens,
            self.k + 1 + self.no_sync,  # one-token mode: a step the host has not seen yet
            self.max_model_len,
        )
        self.cost = None
        if spec.enabled and spec.picks_k:
            self.cost = build_cost_model(
                self.model, self.drafter, config.max_running, self.k, spec.calibration
            )

    def _pages_for(self, memory_bytes: int, dtype: torch.dtype) -> int:
        cfg = self.model.config
        per_page = KVCache.bytes_per_page(
            cfg.num_layers, self.config.kv.page_size, cfg.num_kv_heads, cfg.head_dim, dtype
        )
        return max(1, memory_bytes // (2 * per_page))  # half for a drafter's cache

    def _new_cache(self, model: Any, num_pages: int, dtype: torch.dtype) -> KVCache:
        cfg = model.config
        return KVCache(
            cfg.num_layers,
            num_pages,
            self.config.kv.page_size,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            self.device,
        )

    # ---- the public interface ----

    async def start(self) -> None:
        self._switch_interval = sys.getswitchinterval()
        sys.setswitchinterval(min(self._switch_interval, SWITCH_INTERVAL_S))
        delay, device = self.config.device_delay, self.device
        self.compute = Stream(device, "compute", delay, seed=1)
        # copies overlap compute only on a GPU; on the CPU the host does them itself (a thread
        # hand-off each way would cost more than the copy)
        copies = device.type == "cuda"
        self.h2d = Stream(device, "h2d", delay, seed=2) if copies else None
        self.d2h = Stream(device, "d2h", delay, seed=3) if copies else None
        self.host_buffers = HostBuffers(device)
        self._wake = asyncio.Event()
        self._published = -1  # the last step whose tokens reached the requests
        self._last_publish = time.monotonic()
        self._publishes = asyncio.Event()  # set at each publish
        self._progress = time.monotonic()  # the last step's end, or when work last arrived
        self._completed: dict[int, Plan] = {}  # steps whose pages wait for their device work
        # the last batch's requests and the sampling tensors built for them
        self._sampling: tuple[list[Request], SamplingTensors] | None = None
        planned = asyncio.Queue[Plan]()  # steps handed to the device, in order
        self._tasks = [
            asyncio.create_task(self._plan_loop(planned), name="plan"),
            asyncio.create_task(self._publish_loop(planned), name="publish"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._loop_ended)

    async def stop(self) -> None:
        for request_id in list(self.outputs):
            self.abort(request_id)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        for stream in (self.compute, self.h2d, self.d2h):
            if stream is not None:
                stream.close()
        self.tracer.close()
        sys.setswitchinterval(self._switch_interval)

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> RequestStream:
        """Queue a request; raises InvalidRequest, Overloaded or EngineFailed at once."""
        if self.failure is not None:
            raise EngineFailed(self.failure)
        ids = self._prompt_ids(prompt)
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                f"context length of {self.max_model_len} tokens"
            )
        slots = self.scheduler.slots_needed(len(ids) + params.max_tokens)
        if -(-slots // self.config.kv.page_size) > self.allocator.num_pages:
            raise InvalidRequest(
                f"prompt ({len(ids)} tokens) plus max_tokens ({params.max_tokens}) needs more KV "
                f"pages than the engine has ({self.allocator.num_pages})"
            )
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise Overloaded(f"{len(self.scheduler.waiting)} requests are already waiting")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.outputs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else hash((self.config.seed, request_id))
        request = Request(request_id, ids, params, seed, time.monotonic())
        if not self.outputs:  # the watchdog counts from the first pending request
            self._progress = time.monotonic()
        self.outputs[request_id] = OutputStream(request, self.tokenizer, self.max_model_len)
        stream = self.streams[request_id] = RequestStream(self, request_id)
        self.scheduler.add(request)
        self.metrics.add_tokens(prompt=len(ids))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now; its pages return once no queued step writes them."""
        output = self.outputs.get(request_id)
        if output is not None:
            self._finish(output, output.finish(FinishReason.ABORT))

    async def wait_idle(self) -> None:
        """Until no step is in flight and every finished request's pages are back."""
        while self._completed or self.scheduler.running or self.scheduler.waiting:
            await asyncio.sleep(0.005)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> list[Delta]:
        """All deltas of one request (a convenience for tests and benchmarks)."""
        return [delta async for delta in self.submit(prompt, params)]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt)
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequest(f"token id {bad[0]!r} is outside the vocabulary")
        if not ids:
            raise InvalidRequest("the prompt is empty")
        return ids

    # ---- the step pipeline ----

    async def _plan_loop(self, outbox: asyncio.Queue[Plan]) -> None:
        # Plain decoding and MTP's one-token mode may run one step ahead of the host (the
        # insert kernel settles the lengths on the device); other speculation needs them.
        lag = 2 if self.config.pipelined and (not self.k or self.no_sync) else 1
        for step in itertools.count():
            while self._published < step - lag:
                self._publishes.clear()
                await self._publishes.wait()
            while (planned := self._plan(step)) is None:
                await self._idle()
            plan, packed = planned
            await self._upload(plan, packed)
            self._submit_stages(plan)
            outbox.put_nowait(plan)

    async def _idle(self) -> None:
        """Nothing to run: wait for a step to complete (its pages come back) or for news."""
        if self._completed:
            await _settled(self._completed[min(self._completed)].events["refill"])
            return
        self._wake.clear()
        await self._wake.wait()

    def _plan(self, step: int) -> tuple[Plan, tuple[list[int], dict[str, int]]] | None:
        """The step's plan and its packed fields; None when there is nothing to run. A plan
        that fails fails its requests (planning each alone finds the culprits), and the step
        is planned again without them."""
        start = time.perf_counter()
        self._release_completed()
        batch = self.scheduler.schedule(step)
        if batch is None:
            return None
        try:
            plan = self._make_plan(step, batch)
            packed = pack(plan.fields)
        except Exception as error:  # noqa: BLE001 - a plan's fault fails requests, not the loop
            self._plan_failed(step, batch, error)
            return self._plan(step)  # at once, without the failed requests
        for seq, chunk, emits in zip(batch.seqs, batch.chunks, plan.emits, strict=True):
            seq.request.inflight += 1
            seq.num_prefilled += chunk
            seq.num_pending += int(emits)
        self.tracer.record(
            step,
            "plan",
            start,
            time.perf_counter(),
            batch_size=len(batch.seqs),
            num_tokens=plan.num_tokens,
            kind=batch.kind,
            k=plan.k,
        )
        return plan, packed

    def _make_plan(self, step: int, batch: Batch) -> Plan:
        """What the device needs for the batch's step: no state changes but a cache."""
        k = self._draft_length(batch.seqs) if batch.kind == "decode" else 0
        plan = make_plan(
            batch,
            step,
            k,
            self.config.kv.page_size,
            self.drafter.host_drafts(batch.seqs, k) if k else None,
            [int(self.no_sync and s.request.inflight > 0) for s in batch.seqs],
        )
        params = [s.request.params for s in batch.seqs]
        plan.sampling = self._sampling_tensors(batch.seqs)
        wanted = [p.logprobs for p in params if p.logprobs is not None]
        plan.top_logprobs = max(wanted) if wanted else None
        return plan

    def _plan_failed(self, step: int, batch: Batch, error: Exception) -> None:
        """Fail the requests whose own plan fails (planned alone); when none does, the fault
        is the step's, and every request of the batch fails."""
        culprits = [s for s in batch.seqs if self._fails_alone(step, batch, s)]
        message = f"the request could not be planned: {type(error).__name__}: {error}"
        if culprits:
            ids = [s.request.request_id for s in culprits]
            log.warning("step %d: %s failed its plan: %s", step, ids, error)
        else:
            log.error("step %d could not be planned", step, exc_info=error)
            self._step_failed()
        for seq in culprits or batch.seqs:
            seq.last_step = step - 1  # the step never ran: its pages wait for step - 1 only
            self._fail(seq.request.request_id, message)

    def _fails_alone(self, step: int, batch: Batch, seq: Sequence) -> bool:
        chunk = batch.chunks[batch.seqs.index(seq)]
        try:
            pack(self._make_plan(step, Batch(batch.kind, [seq], [chunk])).fields)
        except Exception:  # noqa: BLE001 - any fault of its own plan is the request's
            return True
        return False

    def _sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The batch's sampling tensors; the previous step's when it ran the same requests in
        the same order (decoding steps mostly do: building them is a fifth of a step's host
        time at batch 1)."""
        requests, cached = [s.request for s in seqs], self._sampling
        if cached is not None and len(cached[0]) == len(requests):
            if all(map(operator.is_, requests, cached[0])):
                return cached[1]
        params, seeds = [r.params for r in requests], [r.seed for r in requests]
        tensors = SamplingTensors.build(params, seeds, self.device, self.vocab_size)
        self._sampling = (requests, tensors)
        return tensors

    def _draft_length(self, seqs: list[Sequence]) -> int:
        if self.cost is None:
            return self.k
        caps = [draft_cap(s, self.k) for s in seqs]
        return self.cost.choose([s.request.acceptance.rate for s in seqs], caps)

    async def _upload(self, plan: Plan, packed: tuple[list[int], dict[str, int]]) -> None:
        flat, layout = packed
        copied = await self.host_buffers.upload(plan.step, flat, self.h2d)
        if not copied.done():
            self.compute.wait(copied)
        unpacked = partial(unpack, uploaded=copied, layout=layout)
        plan.uploaded = self.compute.submit(self._traced, "upload", unpacked, plan)

    def _submit_stages(self, plan: Plan) -> None:
        """Hand the step's device stages to the compute stream. The stream runs work in
        submission order, so each stage starts after the one before it, and step N+1's after
        step N's refill, which writes its inputs (tokens, KV)."""
        for fn in (self._draft, self._verify, self._sample, self._refill):
            name = fn.__name__.strip("_")
            plan.events[name] = self.compute.submit(self._traced, name, fn, plan)

    def _traced(self, name: str, fn: Callable[[Plan], Any], plan: Plan) -> Any:
        start = self.compute.item_started  # device time includes the delay mode's sleep
        if self._fault is not None:
            self._fault(name, plan)
        value = fn(plan)
        end = time.perf_counter()
        plan.device_seconds += end - start
        fields = {"batch_size": plan.batch_size, "k": plan.k}
        if name == "refill":  # the drafter's refill forward: tokens a sequence
            fields["drafter_tokens"] = value
        self.tracer.record(plan.step, name, start, end, **fields)
        return value

    def _draft(self, plan: Plan) -> Drafts:
        dev = plan.device()
        if plan.kind == "decode":
            history = self.history
            moves = any(plan.unknown)
            dev.insert_next_tokens(self.insert, history.accepted, history.tokens, moves)
        if plan.k == 0:
            return Drafts(dev.host_drafts)
        return self.drafter.propose(plan, dev)

    def _verify(self, plan: Plan):
        return self.verifier(plan, plan.device(), plan.events["draft"].result())

    def _sample(self, plan: Plan):
        events = plan.events
        return self.sampler(
            plan, plan.device(), events["verify"].result(), events["draft"].result()
        )

    def _refill(self, plan: Plan) -> int:
        events = plan.events
        verdict = events["sample"].result()
        return self.refiller(plan, plan.device(), events["verify"].result(), verdict)

    async def _publish_loop(self, inbox: asyncio.Queue[Plan]) -> None:
        while True:
            plan = await inbox.get()
            self._completed[plan.step] = plan
            try:
                host = await self._fetch(plan)
            except Exception as error:  # a failed stage fails its step's requests only
                self._fail_step(plan, error)
            else:
                self._publish(plan, host)
                self._failed_steps = 0
            self._progress = time.monotonic()
            if not self.config.pipelined:  # the next plan waits for the whole step
                await _settled(plan.events["refill"])
            # the loop wakes once a step: the refill's end is seen by the next publish or plan
            # (a second wake a step cost the demo's decoding 7-8%: each takes the GIL from
            # the compute thread)
            self._published = plan.step
            self._publishes.set()
            self._release_completed()
            self._wake.set()

    async def _fetch(self, plan: Plan) -> dict[str, list]:
        """The step's sampled tokens on the host."""
        if self.d2h is None:
            await plan.events["sample"]
            return self._download(plan)
        self.d2h.wait(plan.events["sample"])
        return await self.d2h.submit(self._download, plan)

    @staticmethod
    def _download(plan: Plan) -> dict[str, list]:
        verdict = plan.events["sample"].result()
        host = {
            "tokens": verdict.tokens.tolist(),
            "emitted": verdict.num_emitted.tolist(),
            "accepted": verdict.num_accepted.tolist(),
        }
        if verdict.logprobs is not None:
            host["logprobs"] = verdict.logprobs.tolist()
            host["top_ids"] = verdict.top_ids.tolist()
            host["top_logprobs"] = verdict.top_logprobs.tolist()
        return host

    def _publish(self, plan: Plan, host: dict[str, list]) -> None:
        now = time.monotonic()
        for i, seq in enumerate(plan.seqs):
            seq.request.inflight -= 1
            seq.num_pending -= int(plan.emits[i])
            emitted = host["emitted"][i]
            seq.num_tokens += emitted
            output = self.outputs.get(seq.request.request_id)
            if output is None or seq.request.finish_reason is not None or not emitted:
                continue  # finished at an earlier step: this step's extra token is dropped
            if plan.k:
                output.usage.spec_steps += 1
                output.usage.draft_tokens += plan.num_drafts[i]
                output.usage.accepted_tokens += host["accepted"][i]
                seq.request.acceptance.observe(plan.num_drafts[i], host["accepted"][i])
            elif self.cost is not None and plan.kind == "decode":  # the cost model chose k = 0
                seq.request.acceptance.idle()
            tokens = host["tokens"][i][:emitted]
            delta = output.add(tokens, self._logprobs(host, i, emitted, seq))
            self._observe_latency(output, len(delta.token_ids), now)
            self._send(delta)
            if delta.finish_reason is not None:
                self._finish(output, None)
        if plan.k:
            self.metrics.observe_spec(plan.num_drafts, host["accepted"])
        self.metrics.observe_step(
            now - self._last_publish, plan.k if plan.kind == "decode" else None
        )
        self._last_publish = now

    def _observe_latency(self, output: OutputStream, num_tokens: int, now: float) -> None:
        self.metrics.add_tokens(generated=num_tokens)
        if output.last_token_time is None:
            self.metrics.observe_ttft(now - output.request.arrival)
        elif num_tokens:
            for _ in range(num_tokens):
                self.metrics.observe_inter_token((now - output.last_token_time) / num_tokens)
        output.last_token_time = now

    def _update_gauges(self) -> None:
        allocator = self.allocator
        self.metrics.set_requests(len(self.scheduler.running), len(self.scheduler.waiting))
        self.metrics.set_kv_pages(allocator.num_pages - allocator.num_free, allocator.num_pages)

    @staticmethod
    def _logprobs(host: dict, i: int, n: int, seq: Sequence) -> list[TokenLogprob] | None:
        want = seq.request.params.logprobs
        if want is None or "logprobs" not in host:
            return None
        return [
            TokenLogprob(
                host["tokens"][i][j],
                host["logprobs"][i][j],
                list(
                    zip(
                        host["top_ids"][i][j][:want], host["top_logprobs"][i][j][:want], strict=True
                    )
                ),
            )
            for j in range(n)
        ]

    def _fail_step(self, plan: Plan, error: BaseException) -> None:
        log.error("step %d failed on the device", plan.step, exc_info=error)
        message = f"{type(error).__name__}: {error}"
        for seq in plan.seqs:
            seq.request.inflight -= 1
            seq.num_pending -= 1 if seq.num_pending else 0
            self._fail(seq.request.request_id, message)
        self._step_failed()

    def _fail(self, request_id: str, message: str) -> None:
        output = self.outputs.get(request_id)
        if output is not None:
            self._finish(output, output.finish(FinishReason.ERROR, message))

    # ---- supervision ----

    def _step_failed(self) -> None:
        """The circuit breaker: a run of failed steps (a sticky device error, a broken model)
        stops the engine instead of failing every request that comes."""
        self._failed_steps += 1
        if self._failed_steps >= self.config.max_failed_steps:
            self._stop_serving(f"{self._failed_steps} steps in a row failed")

    async def _watchdog(self) -> None:
        """Stop the engine when no step completes for watchdog_s while requests wait."""
        limit = self.config.watchdog_s
        while True:
            await asyncio.sleep(min(1.0, limit / 4))
            if not self.outputs:
                self._progress = time.monotonic()
            elif time.monotonic() - self._progress > limit:
                pending = len(self.outputs)
                self._stop_serving(f"no step completed for {limit:g} s with {pending} requests")
                return

    def _loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            name = task.get_name()
            log.error("the %s loop failed", name, exc_info=error)
            self._stop_serving(f"the {name} loop failed: {type(error).__name__}: {error}")

    def _stop_serving(self, cause: str) -> None:
        """The engine cannot serve any more: fail what runs, refuse what comes, and tell the
        server (which answers /health with 503 and exits, for a supervisor to restart it)."""
        if self.failure is not None:
            return
        log.error("the engine stops serving: %s", cause)
        self.failure = cause
        for request_id in list(self.outputs):
            self._fail(request_id, f"the engine stopped: {cause}")
        self.failed.set()

    def _send(self, delta: Delta) -> None:
        stream = self.streams.get(delta.request_id)
        if stream is not None:
            stream.queue.put_nowait(delta)

    def _finish(self, output: OutputStream, last: Delta | None) -> None:
        """Forget a finished request and free its pages (after the steps that write them)."""
        request = output.request
        if last is not None:
            self._send(last)
        del self.outputs[request.request_id]
        self.streams.pop(request.request_id, None)
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        for seq in list(self.scheduler.running):
            if seq.request is request:
                self.scheduler.release(seq, seq.last_step + 1)
        self.metrics.finish(request.finish_reason or FinishReason.ABORT)
        self._wake.set()

    def _release_completed(self) -> None:
        """Hand back the pages of the steps whose device work has ended, in step order, and
        show the cost model their times."""
        for step in sorted(self._completed):
            plan = self._completed[step]
            if not plan.events["refill"].done():
                break
            self.allocator.release(step)
            del self._completed[step]
            if self.cost is not None and plan.kind == "decode":
                self.cost.observe(plan.batch_size, plan.k, plan.device_seconds)


async def _settled(event: Event) -> None:
    """Until the event's work has ended, whether it succeeded or failed (a failure reaches the
    requests through the step that depends on it)."""
    with contextlib.suppress(Exception):
        await asyncio.wrap_future(event.future)
