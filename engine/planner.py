"""Planning: the next step's batch from the scheduler, made into a Plan on the host
(stages/pack.py) and packed for the device. A plan that fails fails its requests (planning
each alone finds the culprits; when none fails alone, the fault is the step's and all of
them fail), and the step is planned again without them.
"""

from __future__ import annotations

import logging
import operator
import time
from collections.abc import Callable

import torch

from core.params import SamplerLoad, SamplingTensors
from core.request import Request
from core.step import Batch, CatchUp, Plan, Sequence, StepKind
from engine.cost import CostModel
from engine.scheduler import Scheduler
from stages.draft import Drafter
from stages.grammar import host_drafts
from stages.pack import Packed, draft_cap, make_plan, pack

log = logging.getLogger("tandem.engine")


class Planner:
    def __init__(
        self,
        *,
        scheduler: Scheduler,
        drafter: Drafter,  # its host drafts (n-gram)
        cost: CostModel | None,  # chooses each step's k; None: k is fixed
        k: int,  # the most draft tokens a step
        page_size: int,
        vocab_size: int,
        device: torch.device,
        no_sync: bool,  # MTP's one-token mode: steps planned before the last one's tokens
        record: Callable[..., None],  # the step timeline's (engine/trace.py)
        fail: Callable[[str, str], None],  # fail a request: its id and the message
        step_failed: Callable[[], None],  # the circuit breaker's count
        spell: Callable[[str], list[int]] | None = None,  # text -> its usual tokens
    ):
        self.scheduler, self.drafter, self.cost = scheduler, drafter, cost
        self.k, self.page_size, self.vocab_size = k, page_size, vocab_size
        self.device, self.no_sync = device, no_sync
        self.record, self.fail, self.step_failed = record, fail, step_failed
        self.spell = spell  # host drafts spell the strings a grammar forces with it
        # the last batch's requests and the sampling tensors built for them
        self._sampling: tuple[list[Request], SamplingTensors] | None = None

    def plan(self, step: int) -> tuple[Plan, Packed] | None:
        """The step's plan and its packed buffer; None when there is nothing to run."""
        start = time.perf_counter()
        batch = self.scheduler.schedule(step)
        if batch is None:
            return None
        try:
            plan = self._make_plan(step, batch)
            packed = pack(plan.fields)
        except Exception as error:  # noqa: BLE001 - a plan's fault fails requests, not the loop
            self._plan_failed(step, batch, error)
            return self.plan(step)  # at once, without the failed requests
        lacking = self._draft_from(batch.seqs, plan) if self.drafter.lazy_refill else None
        self.scheduler.planned(batch, plan.emits, lacking)
        self.record(
            step,
            "plan",
            start,
            time.perf_counter(),
            batch_size=len(batch.seqs),
            num_tokens=plan.num_tokens,
            kind=batch.kind,
            k=plan.k,
        )
        return plan, packed

    def _make_plan(self, step: int, batch: Batch) -> Plan:
        """What the device needs for the batch's step: no state changes but a cache."""
        decode = batch.kind == StepKind.DECODE
        k = self._draft_length(batch.seqs) if decode else 0
        # asked even where the cost model chose k = 0: a hybrid's suffix drafts cost no model
        drafts = self.drafter.host_drafts(batch.seqs, k) if decode and self.k else None
        # a draft model defers its prefill; in a decode step it runs where it drafts a row,
        # catching up first, or to catch up
        refill, catch_up = not self.drafter.lazy_refill, None
        if decode and self.drafter.lazy_refill:
            drafts, catch_up = self._catch_up(batch.seqs, k, drafts)
            drafting = k > 0 and (drafts is None or any(d is None for d in drafts))
            refill = drafting or catch_up is not None
        if drafts is not None:  # a row of None: the drafter drafts it on the device
            drafts = [
                d if d is None else self._with_grammar(s, d, max(k, len(d)))
                for s, d in zip(batch.seqs, drafts, strict=True)
            ]
            # no wider a step than its longest drafts
            k = max((k if d is None else len(d) for d in drafts), default=0)
        return make_plan(
            batch,
            step,
            k,
            self.page_size,
            self.sampling_tensors(batch.seqs),
            drafts,
            [int(self.no_sync and s.request.inflight > 0) for s in batch.seqs],
            drafter_refill=refill,
            catch_up=catch_up,
            drafted_by=self.drafter.chosen if drafts is not None else None,
        )

    def _with_grammar(self, seq: Sequence, drafts: list[int], k: int) -> list[int]:
        """A request's host drafts as far as its grammar allows them, then what it implies.
        The host drafts while no step is in flight past the last one it saw (a drafter with
        host drafts needs every token), so the matcher is the compute stream's to read then."""
        matcher = seq.request.matcher
        if matcher is None:
            return drafts
        return host_drafts(matcher, drafts, draft_cap(seq, k), self.spell)

    def _plan_failed(self, step: int, batch: Batch, error: Exception) -> None:
        culprits = [s for s in batch.seqs if self._fails_alone(step, batch, s)]
        message = f"the request could not be planned: {type(error).__name__}: {error}"
        if culprits:
            ids = [s.request.request_id for s in culprits]
            log.warning("step %d: %s failed its plan: %s", step, ids, error)
        else:
            log.error("step %d could not be planned", step, exc_info=error)
            self.step_failed()
        for seq in culprits or batch.seqs:
            self.scheduler.unplanned(seq, step)
            self.fail(seq.request.request_id, message)

    def _fails_alone(self, step: int, batch: Batch, seq: Sequence) -> bool:
        chunk = batch.chunks[batch.seqs.index(seq)]
        try:
            pack(self._make_plan(step, Batch(batch.kind, [seq], [chunk])).fields)
        except Exception:  # noqa: BLE001 - any fault of its own plan is the request's
            return True
        return False

    def sampling_tensors(self, seqs: list[Sequence]) -> SamplingTensors:
        """The batch's sampling tensors; the previous step's when it ran the same requests in
        the same order (decoding steps mostly do, and building them is a large share of a
        step's host time at batch 1: bench/results/NOTES.md)."""
        requests, cached = [s.request for s in seqs], self._sampling
        if cached is not None and len(cached[0]) == len(requests):
            if all(map(operator.is_, requests, cached[0])):
                return cached[1]
        params, seeds = [r.params for r in requests], [r.seed for r in requests]
        # on the host: the step's stream copies them to the device (stages/pack.py unpack),
        # so that the event loop never waits for a device copy
        cuda = self.device.type == "cuda"
        tensors = SamplingTensors.build(params, seeds, "cpu", self.vocab_size, pin=cuda)
        self._sampling = (requests, tensors)
        return tensors

    def _catch_up(
        self, seqs: list[Sequence], k: int, drafts: list[list[int] | None] | None
    ) -> tuple[list[list[int] | None] | None, CatchUp | None]:
        """The draft model's catch-up for the rows it is to draft (the drafter plans it within
        the step's token budget), and the drafts: a row still lacking KV after it drafts
        nothing this step (its lag is caught up in chunks, over the next steps)."""
        rows = drafts if drafts is not None else [None] * len(seqs)
        by_model = [k > 0 and d is None for d in rows]
        budget = self.scheduler.max_batch_tokens
        catch_up = self.drafter.plan_catch_up(seqs, by_model, budget)
        if catch_up is None or all(lack is None for lack in catch_up.lacking):
            return drafts, catch_up
        ready = [lack is None for lack in catch_up.lacking]
        return [d if d is not None or r else [] for d, r in zip(rows, ready, strict=True)], catch_up

    @staticmethod
    def _draft_from(seqs: list[Sequence], plan: Plan) -> list[int | None]:
        """Each sequence's first position whose draft-model KV is not written once the step
        has run (Sequence.draft_from): what its catch-up leaves lacking, and where the step
        skips the refill, its own tokens too."""
        lacking = plan.catch_up.lacking if plan.catch_up is not None else None
        after = []
        for i, seq in enumerate(seqs):
            lack = lacking[i] if lacking is not None else seq.draft_from
            if not plan.drafter_refill and lack is None and plan.kind == StepKind.DECODE:
                lack = seq.planned_tokens  # this step's tokens get no draft KV
            after.append(lack)
        return after

    def _draft_length(self, seqs: list[Sequence]) -> int:
        if self.cost is None:
            return self.k
        caps = [draft_cap(s, self.k) for s in seqs]
        rates = [s.request.acceptance.rate for s in seqs]
        return self.cost.choose(rates, caps, SamplerLoad.of([s.request.params for s in seqs]))
