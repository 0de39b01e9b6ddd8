"""Tensor parallelism across processes: the group, the plan's broadcast, the worker ranks.

Rank 0, the leader, holds the HTTP side, the scheduler and the page allocator. Once a step it
packs what the other ranks need (the plan's int32 sections, the sampling parameters, and a
draft model's drafts, which only the leader runs) into one int32 message and broadcasts it;
every rank then runs the same device stages over its slice of the models (models/shard.py).
Each rank samples from the same all-gathered logits with the same keyed randomness
(stages/rng.py keys every draw, no shared generator), so all reach the same verdict without a
second collective, and the leader alone sends it to the host.

A message is a fixed-size int32 buffer (`Group.capacity`), so that one broadcast a step
suffices: its header says what it is and how long its body is; a step that needs more is
preceded by a message that grows every rank's buffer.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from core.params import SamplingTensors
from core.step import Drafts, Plan, StepKind
from models.shard import Shard, traffic

log = logging.getLogger("tandem.parallel")

HEADER = 4  # op, body length, and two spare words
STEP, GROW, STOP = 1, 2, 3
KINDS = (StepKind.PREFILL, StepKind.DECODE)
# tensor dtypes a message carries (int64 and float32 as int32 words; bool as int32 0/1)
DTYPES = (torch.int32, torch.int64, torch.float32, torch.bool)
SAMPLING = (
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seeds",
    "logit_bias",
    "coupled",
)
FLAGS = ("all_greedy", "any_greedy", "any_penalty", "any_top_k_or_p", "any_min_p")
DRAFTS = tuple(f.name for f in dataclasses.fields(Drafts) if f.name not in ("depth", "siblings"))
START_TIMEOUT = timedelta(minutes=10)  # rendezvous; the leader watches its workers meanwhile


@dataclass
class Received:
    """A step as a follower gets it."""

    plan: Plan
    buffer: torch.Tensor  # [n] int32 the plan's packed sections
    layout: dict[str, int]  # section sizes (stages.pack.pack)
    drafts: Drafts | None  # the leader's drafts (a draft model); None: the rank drafts itself


class Group:
    """This process's rank in the tensor-parallel group, and the step messages."""

    def __init__(self, rank: int, size: int, capacity: int = 1 << 12):
        self.rank, self.size = rank, size
        self.shard = Shard(rank, size)
        self.buffer = torch.zeros(capacity, dtype=torch.int32)

    @property
    def leader(self) -> bool:
        return self.rank == 0

    @property
    def capacity(self) -> int:
        return self.buffer.numel()

    # ---- the leader ----

    def send_step(
        self, plan: Plan, buffer: torch.Tensor, layout: dict[str, int], drafts: Drafts | None
    ) -> None:
        """Broadcast a step (encode_step)."""
        self._send(STEP, encode_step(plan, buffer, layout, drafts))

    def stop(self) -> None:
        """Tell the other ranks to leave their loops."""
        self._send(STOP, torch.zeros(0, dtype=torch.int32))

    def _send(self, op: int, body: torch.Tensor) -> None:
        n = HEADER + body.numel()
        if n > self.capacity:
            size = max(n, 2 * self.capacity)
            self.buffer[:2] = torch.tensor([GROW, size])
            self._broadcast()
            self.buffer = torch.zeros(size, dtype=torch.int32)
        self.buffer[:2] = torch.tensor([op, body.numel()])
        self.buffer[HEADER:n] = body
        self._broadcast()

    # ---- the other ranks ----

    def receive(self, fields: tuple[str, ...]) -> Received | None:
        """The next step the leader sends (None: stop). `fields`: the names of the plan's
        sections, in their order (stages.pack.FIELDS)."""
        while True:
            self._broadcast()
            op, length = self.buffer[:2].tolist()
            if op == GROW:
                self.buffer = torch.zeros(length, dtype=torch.int32)
            elif op == STOP:
                return None
            else:
                return decode_step(self.buffer[HEADER : HEADER + length].clone(), fields)

    def _broadcast(self) -> None:
        dist.broadcast(self.buffer, 0)
        traffic.broadcast += self.buffer.numel() * 4


def encode_step(
    plan: Plan, buffer: torch.Tensor, layout: dict[str, int], drafts: Drafts | None
) -> torch.Tensor:
    """[n] int32 a step's message body: `buffer` [n] int32 its packed sections (`layout`
    their sizes), its sampling tensors, and `drafts`, those the leader alone drew (None:
    every rank drafts)."""
    st = plan.sampling
    head = [
        plan.step,
        KINDS.index(plan.kind),
        plan.k,
        plan.page_size,
        -1 if plan.top_logprobs is None else plan.top_logprobs,
        sum(1 << i for i, flag in enumerate(FLAGS) if getattr(st, flag)),
        -1 if drafts is None else drafts.depth,
        0 if drafts is None else drafts.siblings,
        len(layout),
        *layout.values(),
    ]
    parts = [torch.tensor(head, dtype=torch.int32), buffer.to("cpu", torch.int32)]
    parts.append(encode([getattr(st, name) for name in SAMPLING]))
    if drafts is not None:
        parts.append(encode([getattr(drafts, name) for name in DRAFTS]))
    return torch.cat(parts)


def decode_step(body: torch.Tensor, fields: tuple[str, ...]) -> Received:
    """What encode_step wrote; `fields`: the sections' names (stages.pack.FIELDS)."""
    words = body.tolist()
    step, kind, k, page_size, top, flags, depth, siblings, count = words[:9]
    sizes = words[9 : 9 + count]
    at = 9 + count
    layout = dict(zip(fields, sizes, strict=True))
    buffer = body[at : at + sum(sizes)]
    at += sum(sizes)
    values = dict(zip(fields, _split(words[9 + count :], sizes), strict=True))
    tensors, at = decode(body, at, len(SAMPLING))
    named: dict[str, Any] = dict(zip(SAMPLING, tensors, strict=True))
    named |= {flag: bool(flags >> i & 1) for i, flag in enumerate(FLAGS)}
    sampling = SamplingTensors(**named)
    drafts = None
    if depth >= 0:
        tensors, at = decode(body, at, len(DRAFTS))
        parts: dict[str, Any] = dict(zip(DRAFTS, tensors, strict=True))
        drafts = Drafts(**parts, depth=depth, siblings=siblings)
    plan = Plan(
        step=step,
        kind=KINDS[kind],
        seqs=[],  # the leader's; a follower knows the batch by its sections
        k=k,
        num_drafts=values["num_drafts"],
        base=values["base"],
        emits=[bool(e) for e in values["emits"]],
        unknown=values["unknown"],
        page_size=page_size,
        sampling=sampling,
        top_logprobs=None if top < 0 else top,
        fields=values,
    )
    return Received(plan, buffer, layout, drafts)


def _split(words: list[int], sizes: list[int]) -> list[list[int]]:
    out, at = [], 0
    for n in sizes:
        out.append(words[at : at + n])
        at += n
    return out


def encode(tensors: list[torch.Tensor | None]) -> torch.Tensor:
    """[n] int32: each tensor as (dtype code, rank, shape..., its words), -1 for None."""
    parts = []
    for t in tensors:
        if t is None:
            parts.append(torch.tensor([-1], dtype=torch.int32))
            continue
        t = t.detach().to("cpu").contiguous()
        words = (t.int() if t.dtype == torch.bool else t).reshape(-1).view(torch.int32)
        parts += [torch.tensor([DTYPES.index(t.dtype), t.dim(), *t.shape], dtype=torch.int32)]
        parts.append(words)
    return torch.cat(parts)


def decode(body: torch.Tensor, at: int, count: int) -> tuple[list[torch.Tensor | None], int]:
    """`count` tensors `encode` wrote from word `at` on; and the word after them."""
    out: list[torch.Tensor | None] = []
    for _ in range(count):
        code = int(body[at])
        if code < 0:
            out.append(None)
            at += 1
            continue
        dtype, rank = DTYPES[code], int(body[at + 1])
        shape = body[at + 2 : at + 2 + rank].tolist()
        at += 2 + rank
        numel = 1
        for n in shape:
            numel *= n
        width = 2 if dtype == torch.int64 else 1
        words = body[at : at + numel * width]
        at += numel * width
        if dtype == torch.bool:
            out.append(words.bool().view(shape))
        else:
            out.append(words.clone().view(dtype).view(shape))
    return out, at


# ---------------------------------------------------------------------------------------------
# Processes


def join(rank: int, size: int, address: str) -> Group:
    """Join the group at `address` (tcp://host:port) as `rank`; one compute thread a rank
    on the CPU, as the cores are shared."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // size))
    dist.init_process_group(
        "gloo", init_method=address, rank=rank, world_size=size, timeout=START_TIMEOUT
    )
    return Group(rank, size)


def from_environment(size: int) -> tuple[int, str] | None:
    """(rank, address) where torchrun started this process (RANK, WORLD_SIZE, MASTER_*)."""
    if "RANK" not in os.environ:
        return None
    world = int(os.environ["WORLD_SIZE"])
    if world != size:
        raise ValueError(f"--tensor-parallel-size {size} but torchrun's WORLD_SIZE is {world}")
    address = f"tcp://{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    return int(os.environ["RANK"]), address


class Workers:
    """The ranks 1 .. size-1 that the leader starts on this machine, and their watch: a rank
    that fails to start or dies is named with its cause within a fraction of a second (gloo's
    collectives would wait for it for 30 minutes)."""

    def __init__(self, size: int, target: Callable[..., None], *args: Any):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        context = multiprocessing.get_context("spawn")
        self.reports: Any = context.Queue()  # (rank, "ready") or (rank, the failure)
        self.processes = [
            context.Process(
                target=target,
                args=(rank, size, self.address, self.reports, *args),
                name=f"tandem-rank-{rank}",
                daemon=True,
            )
            for rank in range(1, size)
        ]
        for process in self.processes:
            process.start()
        self.ready: set[int] = set()
        self.failure: str | None = None

    def check(self) -> str | None:
        """The first failure seen: a rank's own report, or its exit."""
        self._drain()
        if self.failure is None:
            for rank, process in enumerate(self.processes, 1):
                if process.exitcode is not None:
                    self._drain()  # its report may have arrived meanwhile
                    self.failure = self.failure or f"rank {rank} exited ({_exit(process)})"
                    break
        return self.failure

    def _drain(self) -> None:
        while True:
            try:
                rank, report = self.reports.get_nowait()
            except queue.Empty:
                return
            if report == "ready":
                self.ready.add(rank)
            elif self.failure is None:
                self.failure = f"rank {rank} failed: {report}"

    def wait(self, condition: Callable[[], bool], what: str) -> None:
        """Until `condition()` holds; raises RuntimeError naming the rank that failed."""
        while not condition():
            if (failure := self.check()) is not None:
                raise RuntimeError(f"{what}: {failure}")
            time.sleep(0.05)

    def join_as_leader(self, size: int) -> Group:
        """Rank 0's join, while the workers are watched."""
        joined: list[Group | BaseException] = []

        def run() -> None:
            try:
                joined.append(join(0, size, self.address))
            except BaseException as error:  # noqa: BLE001 - handed to the caller
                joined.append(error)

        threading.Thread(target=run, name="tandem-join", daemon=True).start()
        self.wait(lambda: bool(joined), "the tensor-parallel group did not form")
        if isinstance(joined[0], BaseException):
            raise joined[0]
        return joined[0]

    def stop(self, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
                process.join()


def _exit(process: Any) -> str:
    code = process.exitcode
    if code < 0:
        import signal

        return f"killed by {signal.Signals(-code).name}"
    return f"exit code {code}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
