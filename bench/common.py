"""What the benchmarks share: the held-out prompts, percentiles, timing, and paged attention
over a batch of sequences for timing one forward alone."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from kv.cache import KVCache
from kv.pages import PageAllocator
from kv.table import PageTable, build_csr
from models.attention import TorchPagedAttention, paged_metadata

PROMPTS = Path(__file__).resolve().parent.parent / "train" / "heldout_prompts.json"


def heldout_prompts(n: int) -> list[str]:
    """The first n held-out prompts (texts the demo models never trained on)."""
    return [p["text"] for p in json.loads(PROMPTS.read_text())][:n]


def percentile(values: list[float], p: float) -> float:
    """The nearest-rank p-th percentile; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_seconds(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of `repeats` calls, after one untimed warm-up call."""
    fn()
    return statistics.median(timed(fn) for _ in range(repeats))


def paged_attention(
    tables: list[PageTable], cache: KVCache, num_heads: int, start: int, q_len: int
) -> tuple[TorchPagedAttention, torch.Tensor]:
    """Attention for q_len new tokens per sequence at positions start .. start + q_len - 1,
    over the keys before them in `tables`; also the positions [len(tables) * q_len]."""
    end = start + q_len
    csr = build_csr(tables, [end] * len(tables), [q_len] * len(tables))
    positions = torch.arange(start, end, device=cache.data.device).repeat(len(tables))  # [T]
    meta = paged_metadata(
        torch.tensor(csr.qo_indptr, dtype=torch.int32),
        torch.tensor(csr.kv_indptr, dtype=torch.int32),
        torch.tensor(csr.kv_indices, dtype=torch.int32),
        torch.tensor(csr.kv_last_page_len, dtype=torch.int32),
        positions,
        torch.tensor([s for t in tables for s in t.slots(start, end)], dtype=torch.int32),
        cache.page_size,
        q_len,
        end,
    )
    return TorchPagedAttention(meta, cache, num_heads), positions


def paged_tables(batch: int, num_slots: int, page_size: int) -> tuple[PageAllocator, list]:
    """An allocator and `batch` page tables of `num_slots` slots each, pages interleaved."""
    pages_per_seq = -(-num_slots // page_size)
    allocator = PageAllocator(batch * pages_per_seq)
    tables = [PageTable(page_size) for _ in range(batch)]
    for table in tables:
        table.grow(allocator, num_slots)
    return allocator, tables


def text_table(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table of already formatted cells."""
    lines = [header, *([str(c) for c in row] for row in rows)]
    rule = "|" + "---|" * len(header)
    return "\n".join(
        ["| " + " | ".join(lines[0]) + " |", rule]
        + ["| " + " | ".join(r) + " |" for r in lines[1:]]
    )


class EngineProcess:
    """An engine in a process of its own (spawned), one job at a time: `run(job, *args)` runs
    `await job(engine, *args)` there (`job` a module-level coroutine function, its arguments
    and result picklable). Processes, not engines side by side: after a speculative engine has
    run in a process, plain decoding there runs slower (bench/results/NOTES.md)."""

    def __init__(self, config: Any):
        spawn = multiprocessing.get_context("spawn")
        self.pool = ProcessPoolExecutor(1, mp_context=spawn, initializer=_start, initargs=(config,))

    def run(self, job: Callable[..., Awaitable[Any]], *args: Any) -> Any:
        return self.pool.submit(_run, job, *args).result()

    def close(self) -> None:
        self.pool.submit(_stop).result()
        self.pool.shutdown()


_here: dict[str, Any] = {}  # an EngineProcess's engine and event loop


def _start(config: Any) -> None:
    from engine.engine import AsyncEngine

    loop = _here["loop"] = asyncio.new_event_loop()
    engine = _here["engine"] = AsyncEngine(config)
    loop.run_until_complete(engine.start())


def _run(job: Callable[..., Awaitable[Any]], *args: Any) -> Any:
    return _here["loop"].run_until_complete(job(_here["engine"], *args))


def _stop() -> None:
    _here["loop"].run_until_complete(_here["engine"].stop())
