"""A tensor-parallel rank other than the leader: its slice of the models, and the steps the
leader broadcasts (engine/parallel.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from engine.builder import Builder
from engine.config import EngineConfig
from engine.executor import Executor
from engine.parallel import Group, join
from engine.trace import Tracer


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
    executor = Executor(torch.device(config.device), built.stages, tracer.record, 0.0, group)
    ready()
    try:
        executor.follow()
    finally:
        executor.close()
        tracer.close()
