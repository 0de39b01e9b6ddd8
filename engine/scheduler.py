"""Continuous batching: who runs in the next step, and the KV pages they need.

A step is either a prefill step (prompt chunks of newly admitted requests) or a decode step
(every running request, one token or one speculative draft each), never both, so that
decodes keep speculating while requests arrive. After a prefill step the next step is a decode
step whenever there are decodes, so arrivals cannot starve them.
"""

from __future__ import annotations

import bisect
from collections import deque

from core.request import ENGINE_FADE, ENGINE_FORGET, FREE_DRAFTERS, MODEL, AcceptanceRate, Request
from core.step import Batch, Sequence, StepKind
from kv.pages import OutOfPages, PageAllocator
from kv.prefix import PrefixIndex
from kv.table import PageTable


class Scheduler:
    def __init__(
        self,
        allocator: PageAllocator,
        page_size: int,
        max_running: int,
        max_batch_tokens: int,
        lookahead: int,
        max_model_len: int,
        defer_drafts: bool = False,  # a draft model defers its prefill (Drafter.lazy_refill)
    ):
        self.allocator = allocator
        self.page_size = page_size
        self.max_running = max_running
        self.max_batch_tokens = max_batch_tokens
        self.lookahead = lookahead  # slots a decode step writes past the committed tokens
        self.max_model_len = max_model_len
        self.defer_drafts = defer_drafts
        self.waiting: deque[Request] = deque()
        self.running: list[Sequence] = []
        self.free_rows = list(range(max_running - 1, -1, -1))
        self.num_preemptions = 0
        self._last_kind = StepKind.DECODE
        # each drafter's acceptance across the requests: a new request's prior (core/request.py)
        self.priors = {
            name: AcceptanceRate(forget=ENGINE_FORGET, fade=ENGINE_FADE)
            for name in (MODEL, *FREE_DRAFTERS)
        }

    @property
    def prefixes(self) -> PrefixIndex | None:
        """The prefix cache's index; None: no prefix caching."""
        return self.allocator.prefixes

    def add(self, request: Request) -> None:
        """Queued; its drafters' estimates start from what they accepted for the requests
        before it."""
        for name, estimate in _estimates(request).items():
            estimate.restart(self.priors[name].rate)
        self.waiting.append(request)

    def schedule(self, step: int, lookahead: int | None = None) -> Batch | None:
        """The next step's batch, with pages grown for what it writes; None when idle."""
        lookahead = self.lookahead if lookahead is None else lookahead
        decoding = [s for s in self.running if not s.prefilling and not self._exhausted(s)]
        want_prefill = self.waiting or any(s.prefilling for s in self.running)
        if want_prefill and (self._last_kind == StepKind.DECODE or not decoding):
            batch = self._schedule_prefill(step)
            if batch is not None:
                self._last_kind = StepKind.PREFILL
                return batch
        if not decoding:
            return None
        self._last_kind = StepKind.DECODE
        batch = self._schedule_decode(step, lookahead)
        return batch if batch.seqs else None

    def planned(
        self, batch: Batch, emits: list[bool], draft_from: list[int | None] | None = None
    ) -> None:
        """The batch's step is planned: its prompt chunks count as prefilled, and the tokens
        it will emit as pending until they are published; `draft_from` [B]: each sequence's
        first position whose draft-model KV the step leaves unwritten (None: none)."""
        for i, (seq, chunk, emitting) in enumerate(
            zip(batch.seqs, batch.chunks, emits, strict=True)
        ):
            seq.request.inflight += 1
            seq.num_prefilled += chunk
            if draft_from is not None:
                seq.draft_from = draft_from[i]
            seq.num_pending += int(emitting)

    def landed(self, seq: Sequence, emits: bool, emitted: int) -> None:
        """A step of `seq` has reached the host: its pending token (where it `emits`) becomes
        `emitted` committed ones (the counterpart of `planned`)."""
        seq.request.inflight -= 1
        seq.num_pending -= int(emits)
        if self.prefixes is not None and emitted and seq.num_tokens == len(seq.prefill_ids):
            # its prefill has run; the draft model's KV is written up to draft_from
            self.prefixes.insert(seq.prefill_ids, seq.table.pages, seq.draft_from)
        seq.num_tokens += emitted

    def observe(
        self, request: Request, drafted: int | None, accepted: int = 0, by: str | None = None
    ) -> None:
        """What a decode step's drafts did for the request's acceptance estimates: the
        model's (the cost model's), and under a policy (`by`: who drafted, "" none) the free
        drafters'; `drafted` None: the cost model chose not to draft. The estimates of the
        drafters that did not draft fade toward the prior, so that they are tried again."""
        drafter = by if by in request.free_rates else None
        if drafter is None and by != "" and drafted is not None:
            drafter = MODEL
        for name, estimate in _estimates(request).items():
            prior = self.priors[name]
            for rate in (prior, estimate):
                if name == drafter:
                    rate.observe(drafted or 0, accepted)
                else:
                    rate.idle()
            estimate.prior = prior.rate

    def unplanned(self, seq: Sequence, step: int) -> None:
        """The step was planned but never ran: the sequence's pages wait for the one before."""
        seq.last_step = step - 1

    def finish(self, request: Request) -> None:
        """The request has ended: out of the queue, or its sequence dropped (its pages return
        after the steps that write them)."""
        if request in self.waiting:
            self.waiting.remove(request)
        for seq in [s for s in self.running if s.request is request]:
            self.release(seq, seq.last_step + 1)

    def slots_needed(self, num_tokens: int) -> int:
        """Slots a request of num_tokens committed tokens holds before its next decode step."""
        return num_tokens + self.lookahead + 1

    def _exhausted(self, seq: Sequence) -> bool:
        """In-flight steps will take the sequence to its limit: nothing left to plan."""
        generated = seq.planned_tokens - len(seq.request.prompt_ids)
        return (
            generated >= seq.request.params.max_tokens or seq.planned_tokens >= self.max_model_len
        )

    def _schedule_prefill(self, step: int) -> Batch | None:
        seqs: list[Sequence] = []
        chunks: list[int] = []
        budget = self.max_batch_tokens
        for seq in [s for s in self.running if s.prefilling]:
            if budget > 0 and self._grow(seq, budget, step, seqs, chunks):
                budget -= chunks[-1]
        # a preempted request waits until its in-flight steps have reported their tokens
        while self.waiting and budget > 0 and self.free_rows and not self.waiting[0].inflight:
            seq = self._admit(self.waiting[0])
            if not self._grow(seq, budget, step, seqs, chunks):
                seq.table.truncate(self.allocator, 0)  # a prefix hit's pages
                self.free_rows.append(seq.row)
                break
            if self.prefixes is not None:
                self.prefixes.record(len(seq.prefill_ids) - 1, seq.num_cached)
            self.waiting.popleft()
            self.running.append(seq)
            budget -= chunks[-1]
        return Batch(StepKind.PREFILL, seqs, chunks) if seqs else None

    def _admit(self, request: Request) -> Sequence:
        """The request's sequence, holding the pages of its longest cached prefix (short of
        its last token, whose logits the prefill must compute)."""
        ids = request.all_ids
        table = PageTable(self.page_size)
        if self.prefixes is not None:
            table.pages = self.prefixes.match(ids, len(ids) - 1)
            self.allocator.share(table.pages)
        cached = table.capacity
        seq = Sequence(request, table, self.free_rows.pop(), num_cached=cached)
        if self.defer_drafts:  # the draft model's KV: as far as the hit's pages hold it
            prefixes = self.prefixes
            seq.draft_from = prefixes.drafted_tokens(table.pages) if prefixes is not None else 0
        seq.prefill_ids = ids
        seq.num_tokens = len(ids)
        seq.num_prefilled = cached
        return seq

    def _grow(self, seq: Sequence, budget: int, step: int, seqs: list, chunks: list) -> bool:
        chunk = min(budget, len(seq.prefill_ids) - seq.num_prefilled)
        # Admission reserves the whole prompt and the first decode step's slots: a request
        # whose later chunks had to wait for pages could deadlock with others doing the same.
        try:
            seq.table.grow(self.allocator, self.slots_needed(len(seq.prefill_ids)))
        except OutOfPages:
            return False
        seq.last_step = step
        seqs.append(seq)
        chunks.append(chunk)
        return True

    def _schedule_decode(self, step: int, lookahead: int) -> Batch:
        seqs: list[Sequence] = []
        decoding = [s for s in self.running if not s.prefilling and not self._exhausted(s)]
        for seq in sorted(decoding, key=lambda s: s.request.arrival):
            while seq in self.running:
                try:
                    seq.table.grow(self.allocator, seq.planned_tokens + lookahead)
                    break
                except OutOfPages:
                    self._preempt(step, exclude=seqs + [seq])
            if seq in self.running:
                seq.last_step = step
                seqs.append(seq)
        return Batch(StepKind.DECODE, seqs, [0] * len(seqs))

    def _preempt(self, step: int, exclude: list[Sequence]) -> None:
        """Free the youngest request's pages; it is recomputed from its tokens later."""
        candidates = [s for s in self.running if s not in exclude] or exclude[-1:]
        victim = max(candidates, key=lambda s: s.request.arrival)
        self.release(victim, step)
        self.num_preemptions += 1
        bisect.insort(self.waiting, victim.request, key=lambda r: r.arrival)

    def release(self, seq: Sequence, step: int) -> None:
        """Drop a sequence; its pages return once every step that wrote them has completed."""
        if seq not in self.running:
            return
        self.running.remove(seq)
        if self.prefixes is not None and seq.num_tokens > len(seq.prefill_ids):
            # its prompt has run; the KV of every committed token but the last is written
            # (the draft model's up to draft_from)
            end = seq.num_tokens - 1
            drafted = None if seq.draft_from is None else min(end, seq.draft_from)
            self.prefixes.insert(seq.request.all_ids[:end], seq.table.pages, drafted)
        seq.table.truncate(self.allocator, 0, after_step=max(seq.last_step, step - 1))
        self.free_rows.append(seq.row)


def _estimates(request: Request) -> dict[str, AcceptanceRate]:
    """A request's acceptance estimate of each drafter, by name (MODEL: the model's)."""
    return {MODEL: request.acceptance, **request.free_rates}
