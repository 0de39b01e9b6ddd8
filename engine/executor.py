"""The executor: where a step runs on the device.

`run_step` uploads a plan's packed buffer, then hands the step to the compute stream in two
pieces: upload, draft, verify and sample (the step's `sampled` event, whose verdict the host
downloads), then refill (`done`: the step's device work has ended, and its freed pages may be
reused). The stream runs work in submission order, so step N+1's pieces start after step N's
refill, which writes their inputs (tokens, KV). Each stage is timed and traced as it runs.
"""

from __future__ import annotations

import contextlib
from array import array
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from time import perf_counter
from typing import Any

import torch

from core.step import DevicePlan, Drafts, Outcome, Plan, StepKind, TargetOutput, Verdict
from engine.builder import DeviceStages
from engine.config import DebugConfig
from engine.device import Event, Stream
from engine.parallel import Group
from stages.insert import next_tokens
from stages.pack import FIELDS, Packed, unpack

Record = Callable[..., None]  # Tracer.record's signature


@dataclass
class Sampled:
    """What the step's first piece leaves for its refill."""

    dev: DevicePlan
    out: TargetOutput | None  # None: the step ran as one graph, its refill included
    verdict: Verdict
    refilled: int = 0  # one graph's: the drafter's refill columns


@dataclass
class DeviceTime:
    seconds: float = 0.0  # a step's device work, summed over its stages (the stream adds)


@dataclass
class StepRun:
    """A step handed to the device."""

    plan: Plan
    sampled: Event  # value: Sampled
    done: Event  # value: how many tokens per sequence the drafter's refill ran over
    time: DeviceTime  # complete once `done` is


class HostBuffers:
    """Two pinned int32 host buffers used in turn, each reused only after its last upload. On
    the CPU there is nothing to stage: an upload is the tensor itself."""

    def __init__(self, device: torch.device, size: int = 1 << 16):
        self.device = device
        count = 2 if device.type == "cuda" else 0  # the CPU stages nothing
        self.buffers = [torch.empty(size, dtype=torch.int32, pin_memory=True) for _ in range(count)]
        self.uploads: list[Event | None] = [None, None]

    async def upload(self, step: int, values: list[int], stream: Stream | None) -> Event:
        """Copy `values` to the device through buffer step % 2; the event's value is the copy.
        Without a stream (a CPU device) the tensor is made here, at once."""
        if stream is None:  # frombuffer: a quarter of torch.tensor's cost on a list
            return Event.completed(torch.frombuffer(array("i", values), dtype=torch.int32))
        i = step % 2
        previous = self.uploads[i]
        if previous is not None:
            await previous  # its copy must have read the buffer before it is rewritten
        if len(values) > self.buffers[i].numel():
            self.buffers[i] = torch.empty(2 * len(values), dtype=torch.int32, pin_memory=True)
        host = self.buffers[i]
        host[: len(values)] = torch.tensor(values, dtype=torch.int32)
        n, device = len(values), self.device
        event = stream.submit(lambda: host[:n].to(device, non_blocking=True).clone())
        self.uploads[i] = event
        return event


class Executor:
    def __init__(
        self,
        device: torch.device,
        stages: DeviceStages,
        record: Record,
        debug: DebugConfig,
        group: Group | None = None,  # tensor parallelism: this rank's group
    ):
        self.stages = stages
        self.group = group
        self.record = record  # each stage's timeline record
        delay = debug.device_delay
        self.compute = Stream(device, "compute", delay, seed=1)
        # copies overlap compute only on a GPU; on the CPU the host does them itself (a thread
        # hand-off each way would cost more than the copy)
        copies = device.type == "cuda"
        self.h2d = Stream(device, "h2d", delay, seed=2) if copies else None
        self.d2h = Stream(device, "d2h", delay, seed=3) if copies else None
        self.host_buffers = HostBuffers(device)
        self.fault = debug.fault

    async def run_step(self, plan: Plan, packed: Packed) -> StepRun:
        flat, layout = packed
        copied = await self.host_buffers.upload(plan.step, flat, self.h2d)
        if not copied.done():
            self.compute.wait(copied)
        time = DeviceTime()
        sampled = self.compute.submit(self._sample_piece, plan, time, copied, layout)
        done = self.compute.submit(self._refill_piece, plan, time, sampled)
        return StepRun(plan, sampled, done, time)

    async def outcome(self, run: StepRun) -> Outcome:
        """The step's verdict on the host; raises what a failed stage raised."""
        sampled = run.sampled
        if self.d2h is None:
            return Outcome.of((await sampled).verdict)
        self.d2h.wait(sampled)
        return await self.d2h.submit(lambda: Outcome.of(sampled.value().verdict))

    def close(self) -> None:
        """After the work submitted so far has run (and, on a tensor-parallel leader, a
        stop to the other ranks after it)."""
        if self.group is not None and self.group.leader:
            self.compute.submit(self.group.stop)
        for stream in (self.compute, self.h2d, self.d2h):
            if stream is not None:
                stream.close()

    # ---- device work (the compute stream's thread) ----

    def _sample_piece(
        self, plan: Plan, time: DeviceTime, copied: Event, layout: dict[str, int]
    ) -> Sampled:
        start = self.compute.item_started
        graph = self.stages.graph
        if graph is not None and graph.takes(plan):
            return self._whole_step(plan, time, copied.value(), layout, start)
        return self._to_sample(plan, time, copied.value(), layout, None, start)

    def _whole_step(
        self,
        plan: Plan,
        time: DeviceTime,
        buffer: torch.Tensor,
        layout: dict[str, int],
        start: float | None,
    ) -> Sampled:
        """The step as one graph (engine/step_graph.py): insert, draft, verify, sample and
        refill in one stage, `step`."""
        assert self.stages.graph is not None
        with self._stage(plan, time, "upload", None, start):
            dev = unpack(plan, buffer, layout)
        with self._stage(plan, time, "step", dev) as fields:
            verdict, columns = self.stages.graph(plan, dev, self._whole_step_body)
            fields["drafter_tokens"] = columns
        return Sampled(dev, None, verdict, refilled=columns)

    def _whole_step_body(self, plan: Plan, dev: DevicePlan) -> tuple[Verdict, int]:
        """The stages of `_to_sample` and `_refill` in their order, as one body: the insert
        always (a sequence whose previous step the host saw moves by nothing), the draft, the
        verify, the sample and the refill; the verdict and the refill's columns."""
        s = self.stages
        last_token = next_tokens(dev, s.insert, s.history.accepted, s.history.tokens, True)
        drafts = s.drafter.propose(plan, dev)
        out = s.verifier(plan, dev, drafts, last_token)
        verdict = s.sampler(plan, dev, out, drafts)
        return verdict, s.refiller(plan, dev, out, verdict)

    def _to_sample(
        self,
        plan: Plan,
        time: DeviceTime,
        buffer: torch.Tensor,  # [n] int32 the plan's packed sections
        layout: dict[str, int],
        drafts: Drafts | None,  # a follower's: the leader's drafts; None: draft here
        start: float | None = None,
    ) -> Sampled:
        """Upload, draft, verify and sample; a tensor-parallel leader's broadcast around the
        drafts (`_broadcast`)."""
        s = self.stages
        with self._stage(plan, time, "upload", None, start):
            dev = unpack(plan, buffer, layout)
        self._broadcast(plan, time, buffer, layout, None)
        with self._stage(plan, time, "draft", dev):
            last_token = None
            if plan.kind == StepKind.DECODE:
                moves = any(plan.unknown)
                last_token = next_tokens(dev, s.insert, s.history.accepted, s.history.tokens, moves)
            if drafts is None:
                drafts = s.drafter.propose(plan, dev) if plan.k else Drafts(dev.host_drafts)
        self._broadcast(plan, time, buffer, layout, drafts)
        with self._stage(plan, time, "verify", dev):
            out = s.verifier(plan, dev, drafts, last_token)
        with self._stage(plan, time, "sample", dev):
            verdict = s.sampler(plan, dev, out, drafts)
        return Sampled(dev, out, verdict)

    def _broadcast(
        self,
        plan: Plan,
        time: DeviceTime,
        buffer: torch.Tensor,
        layout: dict[str, int],
        drafts: Drafts | None,  # None: called before drafting
    ) -> None:
        """Tensor parallelism's stage: the leader sends the step to the other ranks, before
        drafting where every rank drafts (the plan is all they need), after it where the
        leader alone drafts (a draft model: they get its drafts). Nothing in one process."""
        if self.group is None or not self.group.leader:
            return
        if (drafts is not None) != self.stages.drafter.leader_only:
            return  # not this drafter's point of the step
        with self._stage(plan, time, "broadcast", None) as fields:
            self.group.send_step(plan, buffer, layout, drafts)
            fields["bytes"] = self.group.capacity * 4

    def _refill_piece(self, plan: Plan, time: DeviceTime, sampled: Event) -> int:
        # raises when the step's first piece failed
        return self._refill(plan, time, sampled.value(), self.compute.item_started)

    def _refill(
        self, plan: Plan, time: DeviceTime, first: Sampled, start: float | None = None
    ) -> int:
        if first.out is None:  # refilled inside the step's graph
            return first.refilled
        with self._stage(plan, time, "refill", first.dev, start) as fields:
            tokens = self.stages.refiller(plan, first.dev, first.out, first.verdict)
            fields["drafter_tokens"] = tokens  # the drafter's refill forward: tokens per sequence
        return tokens

    # ---- a follower rank (tensor parallelism) ----

    def follow(self) -> None:
        """Run every step the leader broadcasts, in this thread, until it says stop."""
        assert self.group is not None and not self.group.leader
        while True:
            start = perf_counter()
            received = self.group.receive(FIELDS)
            if received is None:
                return
            plan, time = received.plan, DeviceTime()
            self.record(plan.step, "wait_plan", start, perf_counter(), batch_size=plan.batch_size)
            first = self._to_sample(plan, time, received.buffer, received.layout, received.drafts)
            self._refill(plan, time, first)

    @contextlib.contextmanager
    def _stage(
        self,
        plan: Plan,
        time: DeviceTime,
        name: str,
        dev: DevicePlan | None,
        start: float | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Time and trace one stage; yields the trace record's extra fields. `start`: when
        the stream began the piece (its device time includes the delay mode's sleep)."""
        start = perf_counter() if start is None else start
        if self.fault is not None:
            self.fault(name, plan, dev)
        fields: dict[str, Any] = {"batch_size": plan.batch_size, "k": plan.k}
        yield fields
        end = perf_counter()
        time.seconds += end - start
        self.record(plan.step, name, start, end, **fields)
