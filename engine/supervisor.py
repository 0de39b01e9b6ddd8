"""Supervision: when the engine stops serving, and what it does then.

It stops on a run of failed steps (the circuit breaker: a sticky device error, a broken
model), on no step completing for `watchdog_s` while requests wait, on the death of one of
its loops, and on a tensor-parallel rank's failure. It then fails what runs, refuses what
comes, and tells the server (which answers /health with 503 and exits, for a supervisor to
restart it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

log = logging.getLogger("tandem.engine")


class Supervisor:
    def __init__(
        self,
        *,
        max_failed_steps: int,
        watchdog_s: float,
        live: Callable[[], list[str]],  # the ids of the requests being served
        fail: Callable[[str, str], None],  # fail a request: its id and the message
        watch: Callable[[], str | None] | None = None,  # another rank's failure, if any
    ):
        self.max_failed_steps, self.watchdog_s = max_failed_steps, watchdog_s
        self.live, self.fail, self.watch = live, fail, watch
        self.failure: str | None = None  # the cause, once the engine cannot serve any more
        self.failed = asyncio.Event()
        self._failed_steps = 0  # consecutive steps that failed
        self._progress = time.monotonic()  # the last step's end, or when work last arrived

    def step_ended(self, failed: bool) -> None:
        """A step's outcome reached the host (its tokens, or its failure)."""
        self._progress = time.monotonic()
        if failed:
            self.count_failure()
        else:
            self._failed_steps = 0

    def count_failure(self) -> None:
        """A step failed (on the device, or as a whole when planned): a run of
        `max_failed_steps` of them stops the engine."""
        self._failed_steps += 1
        if self._failed_steps >= self.max_failed_steps:
            self.stop_serving(f"{self._failed_steps} steps in a row failed")

    def arrived(self) -> None:
        """Work arrived while there was none: the watchdog counts from now."""
        self._progress = time.monotonic()

    async def watchdog(self) -> None:
        """Stop the engine when no step completes for watchdog_s while requests wait."""
        limit = self.watchdog_s
        while True:
            await asyncio.sleep(min(1.0 if self.watch is None else 0.2, limit / 4))
            if self.watch is not None and (failure := self.watch()) is not None:
                self.stop_serving(f"tensor parallelism: {failure}")
                return
            pending = len(self.live())
            if not pending:
                self._progress = time.monotonic()
            elif time.monotonic() - self._progress > limit:
                self.stop_serving(f"no step completed for {limit:g} s with {pending} requests")
                return

    def loop_ended(self, task: asyncio.Task) -> None:
        if not task.cancelled() and (error := task.exception()) is not None:
            name = task.get_name()
            log.error("the %s loop failed", name, exc_info=error)
            self.stop_serving(f"the {name} loop failed: {type(error).__name__}: {error}")

    def stop_serving(self, cause: str) -> None:
        """The engine cannot serve any more: fail what runs, refuse what comes, and set
        `failed` for the server."""
        if self.failure is not None:
            return
        log.error("the engine stops serving: %s", cause)
        self.failure = cause
        for request_id in self.live():
            self.fail(request_id, f"the engine stopped: {cause}")
        self.failed.set()
