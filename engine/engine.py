"""AsyncEngine: submit/abort/stream, and the loops that overlap the host with the device.

A step runs plan -> draft -> verify -> sample -> refill -> publish. The plan loop has the
planner (engine/planner.py) plan the scheduler's next batch on the event loop and hands it to
the executor (engine/executor.py), which queues its device work on the compute stream; then
it passes the step to the publish loop,
which waits (without blocking the loop) for the step's tokens to reach the host and hands
them to the publisher (engine/publish.py). The plan of step N+1 needs only step N's accepted
lengths (speculative decoding) or nothing of step N at all (plain decoding, which assumes
every sequence grows by one, and MTP's one-token mode, which assumes no draft was accepted and
lets the device correct that), so it runs while the device still works on step N. The draft
length of each step is the cost model's choice (engine/cost.py). Models, caches and stages are
made by the builder (engine/builder.py); when the engine stops serving is the supervisor's
call (engine/supervisor.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import time
from collections.abc import Callable

import torch

from core.params import Grammar, InvalidRequest, SamplerLoad, SamplingParams
from core.request import Delta, EngineFailed, Overloaded, Request
from core.step import Plan, StepKind
from engine.builder import Builder
from engine.config import EngineConfig
from engine.device import Event, run_on_device
from engine.executor import Executor, StepRun
from engine.grammar_compiler import Grammars
from engine.metrics import EngineMetrics
from engine.parallel import Group
from engine.planner import Planner
from engine.publish import Publisher, RequestStream
from engine.supervisor import Supervisor
from engine.trace import Tracer
from models.shard import traffic
from stages.pack import Packed

log = logging.getLogger("tandem.engine")


class AsyncEngine:
    def __init__(
        self,
        config: EngineConfig,
        group: Group | None = None,
        watch: Callable[[], str | None] | None = None,
    ):
        """`group`: the leader's tensor-parallel group (engine/parallel.py; None: one
        process); `watch`: what has failed among the other ranks (None: nothing yet), which
        stops the engine (parallel.Workers.check)."""
        self.config = config
        self.group = group
        self.device = torch.device(config.device)
        built = run_on_device(self.device, Builder(config, group).build)
        self.model, self.tokenizer, self.model_name = built.model, built.tokenizer, built.model_name
        self.vocab_size = built.model.config.vocab_size
        self.max_model_len = built.max_model_len
        self.k = built.k  # the most draft tokens a step (0: no speculation)
        self.no_sync = config.spec.one_token_mode
        self.allocator, self.scheduler, self.cost = built.allocator, built.scheduler, built.cost
        self.stages = built.stages
        self.drafter = built.stages.drafter
        self.metrics = EngineMetrics(self.k)
        self.metrics.collect = self._update_gauges  # gauges are read when rendered
        self.tracer = Tracer(config.trace_file, rank=None if group is None else group.rank)
        self._wake = asyncio.Event()  # news for the plan loop: a request came or ended
        if group is not None:
            self.metrics.world_size.set(group.size)
        for kind, size in built.memory.items():
            self.metrics.memory_bytes.labels(kind=kind).set(size)
        log.info(
            "holding %s", ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in built.memory.items())
        )
        self.metrics.products.labels(products=built.products).set(1)
        log.info("the target's products: %s", built.products)
        log.info("the KV cache in %s: %s", *config.kv_dtype_choice)
        if built.dequantized:
            log.info(
                "served dequantized (no kernel for their types): %s", ", ".join(built.dequantized)
            )
        self.publisher = Publisher(
            self.tokenizer,
            self.max_model_len,
            self.scheduler,
            self.metrics,
            self.cost,
            ended=self._wake.set,
            drafters=config.spec.drafter_names,
        )
        self.outputs = self.publisher.outputs  # live requests, by id
        self.supervisor = Supervisor(
            max_failed_steps=config.max_failed_steps,
            watchdog_s=config.watchdog_s,
            live=lambda: list(self.outputs),
            fail=self.publisher.fail,
            watch=watch,
        )
        self.planner = Planner(
            scheduler=self.scheduler,
            drafter=self.drafter,
            cost=self.cost,
            k=self.k,
            page_size=config.kv.page_size,
            vocab_size=self.vocab_size,
            device=self.device,
            no_sync=self.no_sync,
            record=self.tracer.record,
            fail=self.publisher.fail,
            step_failed=self.supervisor.count_failure,
            spell=functools.partial(self.tokenizer.encode, add_special_tokens=False),
        )
        self.executor = Executor(
            device=self.device,
            stages=self.stages,
            record=self.tracer.record,
            debug=config.debug,
            group=group,
        )
        self._ids = itertools.count()
        self._tasks: list[asyncio.Task] = []

    @property
    def failure(self) -> str | None:
        """Why the engine stopped serving; None while it serves."""
        return self.supervisor.failure

    @property
    def failed(self) -> asyncio.Event:
        """Set once the engine stops serving."""
        return self.supervisor.failed

    # ---- the public interface ----

    async def start(self) -> None:
        self._published = -1  # the last step whose tokens reached the requests
        self._publishes = asyncio.Event()  # set at each publish
        self._completed: dict[int, StepRun] = {}  # steps whose pages wait for their device work
        handed = asyncio.Queue[StepRun]()  # steps handed to the device, in order
        self._tasks = [
            asyncio.create_task(self._plan_loop(handed), name="plan"),
            asyncio.create_task(self._publish_loop(handed), name="publish"),
            asyncio.create_task(self.supervisor.watchdog(), name="watchdog"),
        ]
        for task in self._tasks:
            task.add_done_callback(self.supervisor.loop_ended)

    async def stop(self) -> None:
        for request_id in list(self.outputs):
            self.abort(request_id)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []
        self.executor.close()
        self.tracer.close()
        if "grammars" in self.__dict__:
            self.grammars.close()

    @functools.cached_property
    def grammars(self) -> Grammars:
        """Structured output's compiler, made at the first request with a grammar."""
        return Grammars(self.tokenizer, self.vocab_size)

    async def compile_grammar(self, grammar: Grammar) -> None:
        """Compile a grammar off the event loop before `submit` takes a request with it;
        raises InvalidRequest (invalid, unsupported, or past the time limit)."""
        if self.group is not None:
            raise InvalidRequest("structured output is not supported under tensor parallelism")
        await self.grammars.compile(grammar)

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
        drafters = self.config.spec.drafters
        if params.speculative_method not in (None, *drafters):
            raise InvalidRequest(
                f"speculative_method {params.speculative_method!r} is not loaded: choose from "
                + ", ".join(drafters)
            )
        # within max_model_len a request fits the KV pool alone (the builder makes it so)
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise Overloaded(f"{len(self.scheduler.waiting)} requests are already waiting")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.outputs:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._derived_seed(request_id)
        # a grammar was compiled already (compile_grammar), or is refused here
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        request = Request(request_id, ids, params, seed, time.monotonic(), matcher=matcher)
        if not self.outputs:  # the watchdog counts from the first pending request
            self.supervisor.arrived()
        stream = self.publisher.add(request)
        self.scheduler.add(request)
        self.metrics.add_tokens(prompt=len(ids))
        self._wake.set()
        return stream

    def abort(self, request_id: str) -> None:
        """End a request now; its pages return once no queued step writes them."""
        self.publisher.abort(request_id)

    async def wait_idle(self) -> None:
        """Until no step is in flight and every finished request's pages are back."""
        while self._completed or self.scheduler.running or self.scheduler.waiting:
            await asyncio.sleep(0.005)

    async def generate(self, prompt: str | list[int], params: SamplingParams) -> list[Delta]:
        """All deltas of one request (a convenience for tests and benchmarks)."""
        if params.grammar is not None:
            await self.compile_grammar(params.grammar)
        return [delta async for delta in self.submit(prompt, params)]

    def _derived_seed(self, request_id: str) -> int:
        """The seed of a request that brings none: a stable hash of the engine's seed and the
        request id (the same in every process, so that runs can be repeated). Such requests
        sample by the rejection rule, which accepts more drafts than the seeded coupling."""
        key = f"{self.config.seed}:{request_id}".encode()
        return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1

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

    # ---- the overlap loops ----

    async def _plan_loop(self, outbox: asyncio.Queue[StepRun]) -> None:
        # Plain decoding and MTP's one-token mode may run one step ahead of the host (the
        # insert kernel settles the lengths on the device); other speculation needs them.
        # After a prefill step the next waits for it: a prompt's chunks then never queue up
        # behind each other, and an abort frees the pages at the end of the running chunk.
        ahead = 2 if self.config.debug.pipelined and (not self.k or self.no_sync) else 1
        lag = ahead
        for step in itertools.count():
            while self._published < step - lag:
                self._publishes.clear()
                await self._publishes.wait()
            while (planned := self._plan(step)) is None:
                await self._idle()
            lag = 1 if planned[0].kind == StepKind.PREFILL else ahead
            outbox.put_nowait(await self.executor.run_step(*planned))

    async def _publish_loop(self, inbox: asyncio.Queue[StepRun]) -> None:
        while True:
            run = await inbox.get()
            plan = run.plan
            self._completed[plan.step] = run
            deliveries = []
            try:
                outcome = await self.executor.outcome(run)
            except Exception as error:  # a failed stage fails its step's requests only
                log.error("step %d failed on the device", plan.step, exc_info=error)
                self.publisher.fail_step(plan, f"{type(error).__name__}: {error}")
                self.supervisor.step_ended(failed=True)
            else:
                deliveries = self.publisher.publish(plan, outcome, time.monotonic())
                self.supervisor.step_ended(failed=False)
            if not self.config.debug.pipelined:  # the next plan waits for the whole step
                await _settled(run.done)
            # the loop wakes once a step: the refill's end is seen by the next publish or plan
            # (a second wake a step costs decoding throughput: each takes the GIL from the
            # compute thread; bench/results/NOTES.md)
            self._published = plan.step
            self._publishes.set()
            self._release_completed()
            self._wake.set()
            if deliveries:  # the planner submits the next step before the streams' readers run
                await asyncio.sleep(0)
                self.publisher.deliver(deliveries)

    async def _idle(self) -> None:
        """Nothing to run: wait for a step to complete (its pages come back) or for news."""
        if self._completed:
            await _settled(self._completed[min(self._completed)].done)
            return
        self._wake.clear()
        await self._wake.wait()

    def _plan(self, step: int) -> tuple[Plan, Packed] | None:
        """The step's plan (engine/planner.py), once the pages of the steps that ended are
        back; None when there is nothing to run."""
        self._release_completed()
        return self.planner.plan(step)

    def _release_completed(self) -> None:
        """Hand back the pages of the steps whose device work has ended, in step order, and
        show the cost model their times."""
        for step in sorted(self._completed):
            run = self._completed[step]
            if not run.done.done():
                break
            self.allocator.release(step)
            del self._completed[step]
            if self.cost is not None and run.plan.kind == StepKind.DECODE:
                load = SamplerLoad.of([seq.request.params for seq in run.plan.seqs])
                self.cost.observe(run.plan.batch_size, run.plan.k, run.time.seconds, load)

    def _update_gauges(self) -> None:
        if self.group is not None:
            for name in ("broadcast", "all_reduce", "all_gather"):
                labels = self.metrics.rank_bytes.labels(rank=self.group.rank, collective=name)
                labels.set(getattr(traffic, name))
        allocator = self.allocator
        self.metrics.set_requests(len(self.scheduler.running), len(self.scheduler.waiting))
        self.metrics.set_kv_pages(allocator.num_pages - allocator.num_free, allocator.num_pages)
        if (prefixes := allocator.prefixes) is not None:
            self.metrics.set_prefix_cache(len(prefixes.key_of), prefixes.hit_rate)


async def _settled(event: Event) -> None:
    """Until the event's work has ended, whether it succeeded or failed (a failure reaches the
    requests through the step that depends on it)."""
    with contextlib.suppress(Exception):
        await asyncio.wrap_future(event.future)
