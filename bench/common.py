"""What the benchmarks share: the held-out prompts in request groups, percentiles, timing, the
machine's read bandwidth, paged attention over a batch of sequences for timing one forward
alone, tables and JSON, a value from /metrics, a timed answer, and an engine in a process of its
own."""

from __future__ import annotations

import asyncio
import json
import math
import multiprocessing
import re
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from core.params import SamplingParams
from core.request import Usage
from kv.cache import KVCache
from kv.pages import PageAllocator
from kv.table import PageTable, build_csr
from models.attention import TorchPagedAttention, paged_metadata
from models.deepseek import DeepseekModel
from models.llama import LlamaModel

if TYPE_CHECKING:
    from engine.engine import AsyncEngine

PROMPTS = Path(__file__).resolve().parent.parent / "train" / "heldout_prompts.json"
PAGE_SIZE = 16  # the KV pages of the benchmarks' engines and of a forward timed alone


def heldout_prompts(n: int) -> list[str]:
    """The first n held-out prompts (texts the demo models never trained on)."""
    return [p["text"] for p in json.loads(PROMPTS.read_text())][:n]


def request_groups(prompts: list[Any], batch: int, count: int) -> list[list[Any]]:
    """ceil(count / batch) groups of `batch` prompts, taken in order (wrapping)."""
    groups = max(1, -(-count // batch))
    return [[prompts[(g * batch + i) % len(prompts)] for i in range(batch)] for g in range(groups)]


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


def read_bandwidth(threads: int = 2, repeats: int = 15) -> float:
    """This machine's read bandwidth in bytes/s: one read-only pass (a sum) over a float32
    buffer of max(128 MiB, 4x the largest cache cpu0 reports), so that every byte comes from
    memory, with `threads` threads; the median of `repeats`. A batch-1 decode reads every
    weight once: its floor is the weights' bytes over this."""
    sizes = Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size")  # "16384K"
    largest = max((int(s.read_text().strip().rstrip("K")) << 10 for s in sizes), default=0)
    nbytes = max(128 << 20, 4 * largest)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(nbytes // 4)  # written once: no page faults timed
        return nbytes / median_seconds(buffer.sum, repeats)
    finally:
        torch.set_num_threads(before)


def forward_call(
    module: torch.nn.Module,
    vocab: int,
    batch: int,
    context: int,
    q_len: int,
    last_logits: bool = False,
    kv_dtype: torch.dtype = torch.float32,
) -> Callable[[], object]:
    """One forward plus logits of `module` over q_len tokens per sequence for `batch` sequences
    with `context` tokens of KV each, ready to call: logits of every token, or (last_logits)
    of each sequence's last. A LlamaModel reads token ids; a head also reads the target's
    hidden states (random here: the cost is the same)."""
    cfg: Any = module.config
    attn, positions = paged_attention(cfg, batch, context, q_len, kv_dtype)
    ids = torch.randint(vocab, (batch * q_len,))  # [T]
    rows = slice(q_len - 1, None, q_len) if last_logits else slice(None)  # of the [T] tokens
    if isinstance(module, LlamaModel | DeepseekModel):
        return lambda: module.logits(module(ids, positions, attn)[0][rows])
    hidden = torch.randn(batch * q_len, cfg.hidden_size)  # [T, H]
    return lambda: module.logits(module(ids, hidden, positions, attn)[rows])


def paged_attention(
    cfg: Any, batch: int, context: int, q_len: int, kv_dtype: torch.dtype = torch.float32
) -> tuple[TorchPagedAttention, torch.Tensor]:
    """Attention for q_len new tokens of each of `batch` sequences, at positions context ..
    context + q_len - 1, over a fresh paged cache for a model of `cfg`; also the positions
    [batch * q_len]."""
    end = context + q_len
    allocator = PageAllocator(batch * -(-end // PAGE_SIZE))
    tables = [PageTable(PAGE_SIZE) for _ in range(batch)]
    for table in tables:
        table.grow(allocator, end)
    cache = KVCache(
        cfg.num_layers,
        allocator.num_pages,
        PAGE_SIZE,
        cfg.num_kv_heads,
        cfg.head_dim,
        kv_dtype,
        queries=torch.float32,
    )
    csr = build_csr(tables, [end] * batch, [q_len] * batch)
    positions = torch.arange(context, end).repeat(batch)  # [T]
    meta = paged_metadata(
        torch.tensor(csr.qo_indptr, dtype=torch.int32),
        torch.tensor(csr.kv_indptr, dtype=torch.int32),
        torch.tensor(csr.kv_indices, dtype=torch.int32),
        torch.tensor(csr.kv_last_page_len, dtype=torch.int32),
        positions,
        torch.tensor([s for t in tables for s in t.slots(context, end)], dtype=torch.int32),
        PAGE_SIZE,
        q_len,
        end,
    )
    return TorchPagedAttention(meta, cache, cfg.num_heads), positions


def text_table(header: list[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table of already formatted cells."""
    lines = [header, *([str(c) for c in row] for row in rows)]
    rule = "|" + "---|" * len(header)
    return "\n".join(
        ["| " + " | ".join(lines[0]) + " |", rule]
        + ["| " + " | ".join(r) + " |" for r in lines[1:]]
    )


def write_json(path: Path, document: Any) -> None:
    """`document` as standard JSON (NaN written as null, paths as text), its folder made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(_without_nan(document), indent=2, default=str) + "\n")


def _without_nan(value: Any) -> Any:
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _without_nan(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_without_nan(v) for v in value]
    return value


def metric(text: str, name: str) -> float | None:
    """The value of the sample `name` (labels included, as written) in /metrics text."""
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else None


@dataclass
class Answer:
    """A request's answer, and when it came."""

    ids: list[int]
    text: str
    ttft: float  # seconds from submitting to the first token
    decode_s: float  # seconds from the first token to the last
    usage: Usage


async def answer(engine: AsyncEngine, prompt: list[int], params: SamplingParams) -> Answer:
    """The answer to `prompt`, timed."""
    start = time.perf_counter()
    first = last = 0.0
    ids: list[int] = []
    text, usage = "", None
    async for delta in engine.submit(prompt, params):
        now = time.perf_counter()
        if delta.token_ids:
            first, last = first or now, now
        ids += delta.token_ids
        text += delta.text
        usage = delta.usage or usage
    assert usage is not None
    return Answer(ids, text, first - start, last - first, usage)


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
