"""Publishing: a step's outcome reaches its requests.

The publisher owns every live request's output (detokenising, stop strings, usage) and the
stream its client reads. Besides the scheduler it is the only code that changes a sequence's
counters: a published step's tokens move from pending to committed. It ends requests
(finished, aborted, failed) and hands their pages back to the scheduler.
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


class Publisher:
    def __init__(
        self,
        tokenizer: Tokenizer,
        max_model_len: int,
        scheduler: Scheduler,
        metrics: EngineMetrics,
        cost: CostModel | None,
        ended: Callable[[], None],  # a request ended: its pages may let a waiting one in
    ):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.scheduler = scheduler
        self.metrics = metrics
        self.cost = cost
        self.ended = ended
        self.outputs: dict[str, OutputStream] = {}
        self.streams: dict[str, RequestStream] = {}
        self._last_publish = time.monotonic()

    def add(self, request: Request) -> RequestStream:
        self.outputs[request.request_id] = OutputStream(request, self.tokenizer, self.max_model_len)
        stream = self.streams[request.request_id] = RequestStream(request.request_id, self.abort)
        return stream

    def publish(self, plan: Plan, outcome: Outcome, now: float) -> None:
        """The step's tokens to its requests; a request that finished at an earlier step
        drops this step's extra token."""
        decode = plan.kind == StepKind.DECODE
        for i, seq in enumerate(plan.seqs):
            emitted = outcome.emitted[i]
            self._landed(plan, i, seq, emitted)
            output = self.outputs.get(seq.request.request_id)
            if output is None or seq.request.finish_reason is not None or not emitted:
                continue
            if plan.k:
                accepted = outcome.accepted[i]
                output.usage.spec_steps += 1
                output.usage.draft_tokens += plan.num_drafts[i]
                output.usage.accepted_tokens += accepted
                seq.request.acceptance.observe(plan.num_drafts[i], accepted)
            elif self.cost is not None and decode:  # the cost model chose k = 0
                seq.request.acceptance.idle()
            tokens = outcome.tokens[i][:emitted]
            delta = output.add(tokens, _logprobs(outcome, i, emitted, seq))
            self._observe_latency(output, len(delta.token_ids), now)
            self._send(delta)
            if delta.finish_reason is not None:
                self.finish(output, None)
        if plan.k:
            self.metrics.observe_spec(plan.num_drafts, outcome.accepted)
        self.metrics.observe_step(now - self._last_publish, plan.k if decode else None)
        self._last_publish = now

    def fail_step(self, plan: Plan, message: str) -> None:
        """A step whose device work failed: its requests fail."""
        for i, seq in enumerate(plan.seqs):
            self._landed(plan, i, seq, 0)
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
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        for seq in list(self.scheduler.running):
            if seq.request is request:
                self.scheduler.release(seq, seq.last_step + 1)
        self.metrics.finish(request.finish_reason or FinishReason.ABORT)
        self.ended()

    @staticmethod
    def _landed(plan: Plan, i: int, seq: Sequence, emitted: int) -> None:
        """Sequence i's step has reached the host: its pending tokens become `emitted`
        committed ones (the counterpart of Scheduler.planned)."""
        seq.request.inflight -= 1
        seq.num_pending -= int(plan.emits[i])
        seq.num_tokens += emitted

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
