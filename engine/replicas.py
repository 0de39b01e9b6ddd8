"""N engine replicas on Ray Serve behind one endpoint: `Replicas` is what server.py needs of an
engine (api.Engine), over Serve deployment handles.

Ray starts, places and restarts the replicas (engine/replica.py); our router (engine/router.py)
picks a replica for each call, inside Ray's routing. What this adds: a request whose replica
refused it (full, or its engine stopped) is sent to another, and one whose replica died before
it delivered a token is sent again; one whose replica died after, or that no replica took,
ends with an error delta (the server has begun a stream's answer by then; a non-streamed
answer is a 503, which the client may send again). /health and
/metrics speak for every replica, from their statuses fetched each REFRESH_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import ray
from prometheus_client.core import GaugeMetricFamily
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentResponseGenerator

from core.params import Grammar, InvalidRequest, SamplingParams
from core.request import Delta, EngineFailed, FinishReason, Overloaded
from engine.builder import model_path
from engine.config import EngineConfig, ReplicasConfig
from engine.grammar_compiler import Grammars
from engine.metrics import Merged
from engine.replica import Described, EngineReplica, Status
from engine.router import LIVE
from models.tokenizer import Tokenizer

log = logging.getLogger("tandem.replicas")

ROOT = Path(__file__).resolve().parent.parent  # the replicas import the same tree
REFRESH_S = 1.0  # how stale /health and /metrics may be
STATUS_TIMEOUT_S = 10.0  # a replica that does not answer its status in this is not counted
CONTROL_S = 1.0  # Serve's controller's loop: how soon it sees a replica's end or a new one
OBJECT_STORE_BYTES = 256 << 20  # a local Ray's shared memory: only deltas travel through it
ROUTERS = {"prefix": "engine.router:PrefixRouter", "ray": "engine.router:RayDefaultRouter"}


class Replicas:
    """The engine replicas as one engine: submit, abort, health and metrics for all."""

    def __init__(self, config: EngineConfig, replicas: ReplicasConfig, shutdown_s: float):
        """Join Ray (or start it here) and deploy the replicas; returns once they serve."""
        self.config, self.replicas, self.shutdown_s = config, replicas, shutdown_s
        self.app = f"tandem-{os.getpid()}"  # one per endpoint, on a cluster shared by several
        self.started_ray = connect(replicas)
        serve.start(proxy_location="Disabled")  # the endpoint is ours: no Serve HTTP proxy
        try:
            made = deployment(config, replicas, shutdown_s)
            self.handle = serve.run(made, name=self.app, route_prefix=None)
        except Exception:  # a replica that cannot start: leave no application behind
            serve.delete(self.app)
            raise
        described: Described = self.handle.describe.remote().result()
        self.model_name, self.max_model_len = described.model_name, described.max_model_len
        self.vocab_size = described.vocab_size
        self.tokenizer = Tokenizer(model_path(config.model))
        self.grammars = Grammars(self.tokenizer, self.vocab_size)
        # at most what the replicas run and queue: past it a 503 at once
        self.capacity = replicas.replicas * (config.max_running + config.max_waiting)
        self.calls: set[str] = set()  # the live requests' ids
        self.statuses: dict[str, Status] = {}  # by replica, as last fetched
        self._serving = time.monotonic()  # when a replica last reported serving
        self._failure: str | None = None
        self.failed = asyncio.Event()
        self._ids = itertools.count()
        self._refresh: asyncio.Task | None = None
        self._streams: dict[str, asyncio.Task] = {}  # the calls under way, by request id
        self._closed = False

    # ---- what server.py calls ----

    @property
    def metrics(self) -> Replicas:
        """What /metrics renders (`render` below)."""
        return self

    @property
    def failure(self) -> str | None:
        """Why no replica serves (for longer than the engine's watchdog); None while one does."""
        return self._failure

    async def start(self) -> None:
        await self.refresh()
        self._refresh = asyncio.create_task(self._refresh_loop(), name="replicas")

    async def stop(self) -> None:
        """Let what runs finish within the shutdown bound, abort the rest, then delete the
        Serve application (and stop a Ray started here)."""
        if self._refresh is not None:
            self._refresh.cancel()
        if self._streams:
            await asyncio.wait(list(self._streams.values()), timeout=self.shutdown_s)
        for request_id in list(self.calls):
            self.abort(request_id)
        await asyncio.gather(*self._streams.values(), return_exceptions=True)
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        serve.delete(self.app)
        LIVE.pop(self.app, None)
        if self.started_ray:
            serve.shutdown()
            ray.shutdown()
        self.grammars.close()

    async def compile_grammar(self, grammar: Grammar) -> None:
        await self.grammars.compile(grammar)  # a bad grammar's 400 here; each replica compiles

    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterator[Delta]:
        """Queue a request on a replica; raises InvalidRequest, Overloaded or EngineFailed at
        once (the checks a replica would make before it streams)."""
        if self._failure is not None:
            raise EngineFailed(self._failure)
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequest("the prompt is empty")
        drafters = self.config.spec.drafters
        if params.speculative_method not in (None, *drafters):
            raise InvalidRequest(
                f"speculative_method {params.speculative_method!r} is not loaded: choose from "
                + ", ".join(drafters)
            )
        if len(self.calls) >= self.capacity:
            raise Overloaded(f"{len(self.calls)} requests are already running or waiting")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.calls:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.calls.add(request_id)
        return self._deltas(ids, params, request_id)

    def abort(self, request_id: str) -> None:
        """End a request now: Ray cancels its call, and the replica frees its pages."""
        self.calls.discard(request_id)
        if (task := self._streams.get(request_id)) is not None:
            task.cancel()

    def render(self) -> str:
        """/metrics: every replica's metrics labelled with its id, and how many serve."""
        texts = {replica: status.metrics for replica, status in sorted(self.statuses.items())}
        live = GaugeMetricFamily("tandem_replicas", "Engine replicas serving.", value=len(texts))
        return Merged(texts, "replica", [live]).render()

    # ---- one request ----

    async def _deltas(
        self, ids: list[int], params: SamplingParams, request_id: str
    ) -> AsyncIterator[Delta]:
        """The request's deltas from the first replica that takes it. The call runs in a task
        of its own, so that an abort cancels it wherever it waits (in Ray's routing too)."""
        queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        task = asyncio.create_task(self._call(ids, params, request_id, queue.put_nowait))
        self._streams[request_id] = task
        task.add_done_callback(lambda t: queue.put_nowait(_ended(t)))
        try:
            while not isinstance(item := await queue.get(), BaseException):
                yield item
                if item.finish_reason is not None:
                    break
            else:
                if not isinstance(item, StopAsyncIteration):
                    raise item
        finally:
            task.cancel()
            self._streams.pop(request_id, None)
            self.calls.discard(request_id)

    async def _call(
        self, ids: list[int], params: SamplingParams, request_id: str, put: Callable[[Delta], None]
    ) -> None:
        avoid: list[str] = []
        error: Exception = Overloaded("every replica is full")
        for _ in range(self.replicas.replicas + 1):
            replica, delivered = None, False
            call = self.handle.options(stream=True).generate
            items = cast(
                DeploymentResponseGenerator,
                call.remote(ids, params, request_id, avoid=tuple(avoid)),
            )
            try:
                async for item in items:
                    if isinstance(item, str):
                        replica = item
                        continue
                    for delta in item:
                        delivered = True
                        put(delta)
                return
            except (Overloaded, EngineFailed) as e:
                avoid.append(replica or "")  # another replica, if one is not full or failed
                error = e
            except RayActorError as e:  # the replica died, or Ray cannot reach it
                error = e
                if delivered:  # the client has some of its tokens: they cannot be taken back
                    break
                log.warning(
                    "replica %s lost request %s before its first token", replica, request_id
                )
        put(_failed(request_id, replica, error))

    # ---- health and metrics ----

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            with contextlib.suppress(Exception):
                await self.refresh()

    async def refresh(self) -> None:
        """Ask each live replica for its status; mark the deployment failed once no replica
        has served for the engine's watchdog time."""
        asked = [self._status(replica) for replica in LIVE.get(self.app, ())]
        answers = await asyncio.gather(*asked, return_exceptions=True)
        self.statuses = {s.replica: s for s in answers if isinstance(s, Status)}
        if any(s.failure is None for s in self.statuses.values()):
            self._serving = time.monotonic()
        elif time.monotonic() - self._serving > self.config.watchdog_s and not self.failed.is_set():
            self._failure = f"no replica has served for {self.config.watchdog_s:g} s"
            self.failed.set()

    async def _status(self, replica: str) -> Status:
        async with asyncio.timeout(STATUS_TIMEOUT_S):
            return await self.handle.status.remote(pin=replica)


def _ended(task: asyncio.Task) -> BaseException:
    """What a request's call left, as its stream's last item."""
    if task.cancelled():
        return StopAsyncIteration()
    return task.exception() or StopAsyncIteration()


def _failed(request_id: str, replica: str | None, error: BaseException) -> Delta:
    """The last delta of a request that no replica finished."""
    if isinstance(error, RayActorError):
        message = f"the replica serving this request ({replica}) stopped: {type(error).__name__}"
    else:
        message = f"no replica took this request: {error}"
    return Delta(
        request_id, [], "", finish_reason=FinishReason.ERROR, error=message, unavailable=True
    )


def connect(replicas: ReplicasConfig) -> bool:
    """Join the cluster at `ray_address`, or start Ray on this machine (returns True then):
    no dashboard, no usage reports; the replicas import this tree."""
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # the engine on the replica's own event loop: a loop thread of its own beside Ray's would
    # share the interpreter lock with it for every delta; Serve's controller looks over the
    # replicas each CONTROL_S (Ray's default 0.1 s costs 4% of a core while nothing happens)
    env = {
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": "0",
        "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": str(CONTROL_S),
    }
    runtime_env = {"env_vars": {"PYTHONPATH": str(ROOT), **env}}
    quiet: dict[str, Any] = dict(
        include_dashboard=False, logging_level=logging.WARNING, runtime_env=runtime_env
    )
    if replicas.ray_address is not None:
        ray.init(address=replicas.ray_address, **quiet)
        return False
    cpus = os.cpu_count() or 1
    if replicas.replicas * replicas.replica_cpus > cpus:
        raise ValueError(
            f"{replicas.replicas} replicas of {replicas.replica_cpus:g} CPUs do not fit this "
            f"machine's {cpus}: lower --replica-cpus"
        )
    ray.init(num_cpus=cpus, object_store_memory=OBJECT_STORE_BYTES, **quiet)
    return True


def deployment(
    config: EngineConfig, replicas: ReplicasConfig, shutdown_s: float
) -> serve.Application:
    """The replicas' deployment: each reserves its CPUs and takes what its engine runs and
    queues (Ray's default is 5 a replica), plus one for a status call."""
    kwargs = {"block": config.kv.page_size, "imbalance": replicas.imbalance}
    router = {
        "request_router_class": ROUTERS[replicas.routing],
        "request_router_kwargs": kwargs if replicas.routing == "prefix" else {},
    }
    made = serve.deployment(
        name="engine",
        num_replicas=replicas.replicas,
        ray_actor_options={"num_cpus": replicas.replica_cpus},
        max_ongoing_requests=config.max_running + config.max_waiting + 1,
        request_router_config=router,
        graceful_shutdown_timeout_s=shutdown_s,
        health_check_period_s=2.0,
        health_check_timeout_s=30.0,
        # a log line a call would cost each request's stream CPU time
        logging_config={"log_level": "WARNING", "enable_access_log": False},
    )
    return made(EngineReplica).bind(config, replicas.threads)
