"""Streams and events: ordered device work, and awaitable markers in it.

A `Stream` runs submitted work in order on a worker thread. On CUDA the work is issued to a
`torch.cuda.Stream`, so the thread only launches kernels; on the CPU the thread does the work
itself (torch releases the GIL inside its ops), and all the CPU's streams share that one
thread. Order across streams comes only from events (`stream.wait(event)`), as on a GPU. An
`Event` marks the end of one piece of work; the event loop awaits it without blocking, and its
value is the work's return value.

`delay` injects a random sleep before each piece of work, so that a missing wait between
streams shows up as a wrong result in tests instead of passing by luck.
"""

from __future__ import annotations

import asyncio
import queue
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import cache, partial
from typing import Any

import torch


class Event:
    """The completion of one piece of stream work, with its return value."""

    def __init__(self, future: Future, cuda_event: Any = None):
        self.future = future
        self.cuda_event = cuda_event

    @classmethod
    def completed(cls, value: Any) -> Event:
        """An event for work already done in the caller's thread."""
        future: Future = Future()
        future.set_result(value)
        return cls(future)

    def done(self) -> bool:
        if not self.future.done():
            return False
        return (
            self.cuda_event is None
            or self.future.exception() is not None
            or (self.cuda_event.query())
        )

    def result(self) -> Any:
        """The work's value once its device work has ended: blocks the calling thread until
        the device is there (on CUDA a host synchronisation), so no step stage calls it."""
        value = self.future.result()
        if self.cuda_event is not None:
            self.cuda_event.synchronize()
        return value

    def value(self) -> Any:
        """The work's value as soon as the host has launched it, its device work maybe still
        queued: for stream work ordered after that work on the device (the same stream, or
        a `Stream.wait` on this event), which must not wait for it on the host."""
        return self.future.result()

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self) -> Any:
        value = await asyncio.wrap_future(self.future)
        while self.cuda_event is not None and not self.cuda_event.query():
            await asyncio.sleep(0.0002)
        return value


class Stream:
    """Work submitted here runs in submission order, after the events it was told to wait for.

    On CUDA each stream has a thread of its own. On the CPU every stream of the process hands
    its work to one shared thread (`cpu_thread`), in submission order: OpenMP gives each thread
    that runs parallel torch work a team of its own, and once there are more team threads than
    cores it stops spinning between parallel regions, which slows every forward
    (bench/results/NOTES.md). One thread doing all the CPU's torch work keeps one team."""

    def __init__(self, device: torch.device, name: str, delay: float = 0.0, seed: int = 0):
        self.device = device
        self.name = name
        self.delay = delay
        self._random = random.Random(seed)
        self._cuda = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.item_started = 0.0  # when the running piece of work began, injected delay included
        self._worker = cpu_thread() if self._cuda is None else _Worker(f"stream-{name}", device)

    def submit(self, fn: Callable[..., Any], *args: Any) -> Event:
        future: Future = Future()
        cuda_event = torch.cuda.Event() if self._cuda is not None else None
        self._worker.put(partial(self._execute, fn, args, future, cuda_event))
        return Event(future, cuda_event)

    def wait(self, event: Event) -> None:
        """Later work on this stream starts only after `event`."""

        def wait_for() -> None:
            event.future.result()
            if event.cuda_event is not None and self._cuda is not None:
                self._cuda.wait_event(event.cuda_event)

        self.submit(wait_for)

    def close(self) -> None:
        """After the work submitted so far has run."""
        if self._worker is cpu_thread():
            self.submit(lambda: None).future.result()
        else:
            self._worker.close()

    def _execute(self, fn: Callable, args: tuple, future: Future, cuda_event: Any) -> None:
        # a cancelled future (its waiter left) still runs its work, as a GPU stream's would:
        # later work depends on it, here and on the other tensor-parallel ranks
        waited = future.set_running_or_notify_cancel()
        self.item_started = time.perf_counter()
        if self.delay:
            threading.Event().wait(self._random.uniform(0, self.delay))
        try:
            if self._cuda is not None:
                with torch.cuda.stream(self._cuda):
                    value = fn(*args)
                    cuda_event.record(self._cuda)
            else:
                value = fn(*args)
        except BaseException as error:  # handed to whoever awaits the event
            if waited:
                future.set_exception(error)
        else:
            if waited:
                future.set_result(value)


class _Worker:
    """A thread running the callables put to it, in order."""

    def __init__(self, name: str, device: torch.device | None = None):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, args=(device,), name=name, daemon=True)
        self.thread.start()

    def put(self, work: Callable[[], None]) -> None:
        self._queue.put(work)

    def close(self) -> None:
        self._queue.put(None)
        self.thread.join()

    def _run(self, device: torch.device | None) -> None:
        if device is not None and device.type == "cuda":
            # "cuda" names no index, which set_device refuses: the current device is meant
            index = device.index if device.index is not None else torch.cuda.current_device()
            torch.cuda.set_device(index)
        # device work never needs autograd; inference mode also skips the version counters
        # and view tracking (measurably faster than no_grad: bench/results/NOTES.md)
        with torch.inference_mode():
            while (work := self._queue.get()) is not None:
                work()


@cache
def cpu_thread() -> _Worker:
    """The process's one thread for CPU torch work (see Stream), started on first use."""
    return _Worker("cpu-compute")


def run_on_device(device: torch.device, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on the thread that does `device`'s work, waiting for its value: model loading
    and calibration, so that on the CPU they too run on the one compute thread."""
    if device.type != "cpu" or threading.current_thread() is cpu_thread().thread:
        return fn(*args)
    return Stream(device, "setup").submit(fn, *args).future.result()
