"""One engine in a Ray Serve replica: the deployment that the endpoint's handles call
(engine/replicas.py). The engine is the one `server.py` runs alone, with its own KV pool and
prefix cache; this wraps its request API in calls that cross processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterable, AsyncIterator
from dataclasses import dataclass
from typing import Any

import torch
from ray import serve

from core.params import SamplingParams
from core.request import Delta
from engine.config import EngineConfig
from engine.engine import AsyncEngine

# each message between processes costs a round of Ray's streaming protocol: deltas that come
# within this of the last message go together in the next (bench/replicas.py, overhead)
SEND_EVERY_S = 0.02


@dataclass(frozen=True)
class Described:
    """What the endpoint needs to know of the served model."""

    model_name: str
    max_model_len: int
    vocab_size: int


@dataclass(frozen=True)
class Status:
    """A replica's state, as the endpoint's /health and /metrics report it."""

    replica: str  # Ray Serve's id of the replica
    pid: int  # its process
    metrics: str  # its engine's Prometheus text
    failure: str | None  # why its engine stopped serving; None while it serves


class EngineReplica:
    """The deployment's class. Every method takes the routers' hints (engine/router.py) as
    keyword arguments, which it does not read."""

    async def __init__(self, config: EngineConfig, threads: int):  # type: ignore[misc]
        torch.set_num_threads(threads)
        self.engine = AsyncEngine(config)
        await self.engine.start()
        self.replica = serve.get_replica_context().replica_id.unique_id

    def describe(self, **hints: Any) -> Described:
        engine = self.engine
        return Described(engine.model_name, engine.max_model_len, engine.vocab_size)

    def status(self, **hints: Any) -> Status:
        engine = self.engine
        return Status(self.replica, os.getpid(), engine.metrics.render(), engine.failure)

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine stopped serving is replaced."""
        if self.engine.failure is not None:
            raise RuntimeError(f"the engine stopped serving: {self.engine.failure}")

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, request_id: str, **hints: Any
    ) -> AsyncIterator[str | list[Delta]]:
        """The replica's id, then the request's deltas in lists; raises what the engine's
        submit raises (InvalidRequest, Overloaded, EngineFailed) after the id."""
        yield self.replica
        if params.grammar is not None:
            await self.engine.compile_grammar(params.grammar)
        deltas = self.engine.submit(prompt_ids, params, request_id)
        finished = False
        try:
            async for batch in batches(deltas, SEND_EVERY_S):
                finished = batch[-1].finish_reason is not None
                yield batch
        finally:
            if not finished:  # the caller left (Ray cancels this generator): free the pages
                self.engine.abort(request_id)


_END = object()


async def batches(deltas: AsyncIterable[Delta], every_s: float) -> AsyncIterator[list[Delta]]:
    """The deltas in lists: the first at once, then, `every_s` after each list, all that came
    meanwhile (at once when nothing came meanwhile, as soon as something does)."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Any] = asyncio.Queue()

    async def pump() -> None:
        async for delta in deltas:
            queue.put_nowait(delta)

    task = asyncio.create_task(pump())
    task.add_done_callback(lambda _: queue.put_nowait(_END))
    try:
        due = loop.time()
        while (first := await queue.get()) is not _END:
            await asyncio.sleep(due - loop.time())
            batch = [first] + [queue.get_nowait() for _ in range(queue.qsize())]
            ended = batch[-1] is _END
            yield [d for d in batch if d is not _END]
            due = loop.time() + every_s
            if ended:
                break
        await task  # the stream's own error, if it raised one
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task
