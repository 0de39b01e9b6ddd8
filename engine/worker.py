"""The processes of a tensor-parallel group on one machine (engine/parallel.py): the leader's
start, and each other rank's loop over the steps the leader broadcasts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from engine.builder import Builder
from engine.config import DebugConfig, EngineConfig
from engine.engine import AsyncEngine
from engine.executor import Executor
from engine.parallel import Group, Workers, join
from engine.trace import Tracer


def start_leader(config: EngineConfig) -> tuple[AsyncEngine, Workers]:
    """This process as rank 0 of `config.tensor_parallel_size` ranks, the others started as
    worker processes, every rank built; raises RuntimeError naming a rank that failed (and
    what building the leader raises)."""
    size = config.tensor_parallel_size
    workers = Workers(size, run_rank, config)
    try:
        group = workers.join_as_leader(size)
        engine = AsyncEngine(config, group, workers.check)
        workers.wait(lambda: len(workers.ready) == size - 1, "a rank did not start")
    except BaseException:
        workers.stop(timeout=0)
        raise
    return engine, workers


def leave(workers: Workers) -> None:
    """After the leader's engine has stopped: the workers' end, and this process's group."""
    workers.stop()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_rank(rank: int, size: int, address: str, reports: Any, config: EngineConfig) -> None:
    """A worker process the leader started (parallel.Workers): it reports ("ready" or its
    failure) on `reports`, and exits non-zero on a failure."""
    try:
        group = join(rank, size, address)
        serve_rank(config, group, lambda: reports.put((rank, "ready")))
    except BaseException as error:
        reports.put((rank, f"{type(error).__name__}: {error}"))
        raise SystemExit(1) from error


def serve_rank(config: EngineConfig, group: Group, ready: Callable[[], None]) -> None:
    """Build this rank's stages, call `ready`, and run the leader's steps until it stops.
    Its trace, with --trace-file, goes to that path + ".rank<N>"."""
    built = Builder(config, group).build()
    path = f"{config.trace_file}.rank{group.rank}" if config.trace_file else None
    tracer = Tracer(path, rank=group.rank)
    device = torch.device(config.device)
    executor = Executor(device, built.stages, tracer.record, DebugConfig(), group)
    ready()
    try:
        executor.follow()
    finally:
        executor.close()
        tracer.close()
