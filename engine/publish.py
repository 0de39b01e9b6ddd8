"""Publishing: a step's outcome reaches its requests.

The publisher turns a step's outcome into each request's deltas (through its OutputStream,
which owns the output: its tokens, text and finish) and events (the client's stream, the
metrics). What a step did to the request's lifecycle (tokens committed, the request ended)
it reports to the scheduler, which owns that state.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from core.request import Delta, FinishReason, Request, TokenLogprob
from core.step import Outcome, Plan, Sequence, StepKind
from engine.cost import CostModel
from engine.metrics import EngineMetrics
from engine.output import OutputStream
from engine.scheduler import Scheduler
from models.tokenizer import Tokenizer


class RequestStream:
    """Async iterator of a request's deltas; closing it early aborts the request."""

    def __init__(self, request_id: str, abort: Callable[[str], None]):
        self.request_id = request_id
        self.queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False
        self._abort = abort

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
            self._abort(self.request_id)
            self.done = True


Delivery = tuple[RequestStream, Delta]


class Publisher:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        cost: CostModel | None,
        ended: Callable[[], None],  # a request ended: its pages may let a waiting one in
        drafters: tuple[str, str] = ("", ""),  # what drafts on the device, and on the host
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.metrics = metrics
        self.cost = cost
        self.ended = ended
        self.drafters = drafters
        self.outputs: dict[str, OutputStream] = {}
        self.streams: dict[str, RequestStream] = {}
        self._last_publish = time.monotonic()

    def add(self, request: Request) -> RequestStream:
        self.outputs[request.request_id] = OutputStream(request, self.tokenizer, self.max_model_len)
        stream = self.streams[request.request_id] = RequestStream(request.request_id, self.abort)
        return stream

    def publish(self, plan: Plan, outcome: Outcome, now: float) -> list[Delivery]:
        """The step's tokens to its requests, as deltas for `deliver` (the engine hands them
        to the streams once the next step is planned: their readers' work then overlaps the
        device's); a request that finished at an earlier step drops this step's extra
        token."""
        decode = plan.kind == StepKind.DECODE
        deliveries = []
        for i, seq in enumerate(plan.seqs):
            emitted = outcome.emitted[i]
            self.scheduler.landed(seq, plan.emits[i], emitted)
            output = self.outputs.get(seq.request.request_id)
            if output is None or seq.request.finish_reason is not None or not emitted:
                continue
            forced = outcome.forced[i] if outcome.forced is not None else [False] * emitted
            output.count_forced(sum(forced[:emitted]))
            if plan.k:
                accepted = outcome.accepted[i]
                free = sum(forced[:accepted])  # accepted drafts the grammar forced
                by = plan.drafted_by[i] if plan.drafted_by is not None else None
                if plan.num_drafts[i]:  # its own drafts: a batch-mate's speculation is not its
                    output.count_drafts(plan.num_drafts[i] - free, accepted - free, by)
                    self.metrics.observe_drafter(by, plan.num_drafts[i], accepted)
                self.scheduler.observe(seq.request, plan.num_drafts[i], accepted, by)
            elif self.cost is not None and decode:  # the cost model chose k = 0
                self.scheduler.observe(seq.request, None)
            if not decode and not seq.request.output_ids:  # its prompt's first prefill
                output.count_cached(seq.num_cached)
            tokens = outcome.tokens[i][:emitted]
            delta = output.add(tokens, _logprobs(outcome, i, emitted, seq))
            delta.drafted = self._drafted(plan, i, outcome.accepted[i])[: len(delta.token_ids)]
            self._observe_latency(output, len(delta.token_ids), now)
            if (stream := self.streams.get(delta.request_id)) is not None:
                deliveries.append((stream, delta))
            if delta.finish_reason is not None:
                self.finish(output, None)
        if plan.k:
            self.metrics.observe_spec(plan.num_drafts, outcome.accepted)
        self.metrics.observe_step(now - self._last_publish, plan.k if decode else None)
        self._last_publish = now
        return deliveries

    def _drafted(self, plan: Plan, i: int, accepted: int) -> list[str | None]:
        """Who proposed each token sequence i emitted: its accepted drafts, then the target's
        own token (the drafter a policy chose, else by where the row was drafted: a host
        draft fills the row's first slot of `host_drafts`)."""
        if not plan.k or not accepted:
            return [None]
        if plan.drafted_by is not None:
            return [plan.drafted_by[i] or None] * accepted + [None]
        host = plan.fields["host_drafts"][i * plan.k] >= 0
        return [self.drafters[host]] * accepted + [None]

    @staticmethod
    def deliver(deliveries: list[Delivery]) -> None:
        for stream, delta in deliveries:
            stream.queue.put_nowait(delta)

    def fail_step(self, plan: Plan, message: str) -> None:
        """A step whose device work failed: its requests fail."""
        for i, seq in enumerate(plan.seqs):
            self.scheduler.landed(seq, plan.emits[i], 0)
            self.fail(seq.request.request_id, message)

    def fail(self, request_id: str, message: str) -> None:
        output = self.outputs.get(request_id)
        if output is not None:
            self.finish(output, output.finish(FinishReason.ERROR, message))

    def abort(self, request_id: str) -> None:
        """End a request now; its pages return once no queued step writes them."""
        output = self.outputs.get(request_id)
        if output is not None:
            self.finish(output, output.finish(FinishReason.ABORT))

    def finish(self, output: OutputStream, last: Delta | None) -> None:
        """Forget a finished request and free its pages (after the steps that write them)."""
        request = output.request
        if last is not None:
            self._send(last)
        del self.outputs[request.request_id]
        self.streams.pop(request.request_id, None)
        self.scheduler.finish(request)
        self.metrics.finish(request.finish_reason or FinishReason.ABORT)
        self.ended()

    def _observe_latency(self, output: OutputStream, num_tokens: int, now: float) -> None:
        self.metrics.add_tokens(generated=num_tokens)
        if output.last_token_time is None:
            self.metrics.observe_ttft(now - output.request.arrival)
        elif num_tokens:
            for _ in range(num_tokens):
                self.metrics.observe_inter_token((now - output.last_token_time) / num_tokens)
        output.last_token_time = now

    def _send(self, delta: Delta) -> None:
        stream = self.streams.get(delta.request_id)
        if stream is not None:
            stream.queue.put_nowait(delta)


def _logprobs(outcome: Outcome, i: int, n: int, seq: Sequence) -> list[TokenLogprob] | None:
    want, lp = seq.request.params.logprobs, outcome.logprobs
    if want is None or lp is None:
        return None
    return [
        TokenLogprob(
            outcome.tokens[i][j],
            lp.chosen[i][j],
            list(zip(lp.top_ids[i][j][:want], lp.top[i][j][:want], strict=True)),
        )
        for j in range(n)
    ]
