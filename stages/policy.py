"""`--speculative auto`: each request drafts, each step, with whatever it expects to give the
most tokens per second of the step: a drafter with no model (n-gram, suffix decoding), the
model (a draft model or an EAGLE or MTP head), or nothing.

The choice is made on the host at plan time, row by row, from the request's own measured
acceptance of each drafter (Request.acceptance for the model, Request.free_rates for the
others: the scheduler updates the one that drafted and lets the others fade toward the prior,
so that a drafter that stopped paying is tried again after a while) and each option's price,
the cost model's curves: a free draft of n tokens costs the row's share of a step whose rows
verify n + 1 positions each (at one row, the verify of n + 1 rows), the model's k drafts the
verify of k + 1 rows and its k forwards, nothing the verify of one row; the sampler's rows
are priced with them. Every row of a step verifies as many positions as the widest, so the
rows' free drafts are then cut to the batch's width that pays for the whole step (where the
model drafts, its k). A draft model that lacks a request's KV (its prefill deferred, refills
skipped) first catches up: that forward is priced too, spread over the steps left to the
request; and leaving a caught-up draft model for a step costs the catch-up that the step's
tokens will need (its refill skipped). A drafter's prior is what it accepted for the engine's
requests before. The model's k is the cost model's choice for the batch (0: the model does
not draft this step). Every choice is lossless because each drafter is: the target verifies
whatever was proposed. A request may name one drafter alone (`speculative_method`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from core.params import SamplerLoad
from core.request import Request, expected_tokens
from core.step import CatchUp, DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from stages.draft import Drafter, NoDrafter, ngram_lookup, with_host_drafts
from stages.suffix import SuffixDrafter

NONE = ""  # a row that drafts nothing
# a request's first steps draft with the model until it has drafted this many, where catching
# the model up costs no more than that many steps of it: priced at the prior alone, a costly
# model (the pair's 0.5B, 0.4 of a target forward a draft) would lose to the lookups and to
# nothing before its acceptance was ever measured; a long prompt's deferred prefill (fill in
# the middle) is not worth the try
TRY_MODEL_STEPS = 2


@dataclasses.dataclass(frozen=True)
class Prices:
    """Seconds of a step: `batch(B, w, load)` of B rows each w drafts wide, proposed at no
    cost, with the sampler's rows of the batch's kinds (`load`); `model(k, load)` a one-row
    step verifying k drafts of the model with its forwards; `catch_up(n)` the model's forward
    over n tokens it lacks (the cost model's curves)."""

    batch: Callable[[int, int, SamplerLoad], float]
    model: Callable[[int, SamplerLoad], float]
    catch_up: Callable[[int], float]


def best_length(rate: float, proposed: int, prices: list[float]) -> tuple[int, float]:
    """The number of a free draft's tokens (0..proposed) that gives the most expected tokens a
    second, and that rate (prices[n]: the step's seconds with n drafts)."""
    rates = [(expected_tokens(rate, n) / prices[n], n) for n in range(proposed + 1)]
    speed, n = max(rates)
    return n, speed


class PolicyDrafter:
    """The drafts of whatever pays, per request and step (the module docstring). `model`: the
    draft model or head that drafts on the device, or NoDrafter where there is none."""

    def __init__(
        self,
        model: Drafter,
        model_name: str,  # what the model is (draft, eagle, mtp): its rows' name
        suffix: SuffixDrafter,
        ngram: tuple[int, int],  # n-gram lookup's shortest and longest suffix
        max_k: int,  # the most tokens of a free draft
        prices: Prices,
    ):
        self.model, self.model_name, self.suffix, self.ngram = model, model_name, suffix, ngram
        self.max_k, self.prices = max_k, prices
        # no model at hand (a target with neither a draft model nor a head): the free drafters
        # alone, and the cost model's k is no model's offer
        self.with_model = not isinstance(model, NoDrafter)
        self.target_layers = model.target_layers
        self.leader_only = model.leader_only
        self.lazy_refill = model.lazy_refill
        self.chosen: list[str] | None = None  # the last plan's drafter of each row

    def free_drafts(self, request: Request) -> dict[str, Callable[[], list[int]]]:
        """What each free drafter would propose for the request, up to max_k tokens (asked
        only where it may pay: a lookup costs host time every step)."""
        lo, hi = self.ngram
        return {
            "ngram": lambda: ngram_lookup(request.all_ids, self.max_k, lo, hi),
            "suffix": lambda: self.suffix.propose_for(request, self.max_k).tokens,
        }

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        """Each row's free draft, [] where it drafts nothing, None where the model drafts (k:
        the cost model's choice for the model)."""
        self.suffix.retire()
        # a row's share of the batch's step by its drafts' width, as if every row drafted as
        # many: at one row a one-row step; at 16 a second position costs SmolLM2 1.9x, so
        # that a lookup no row could pay for is not even asked for
        load, size = SamplerLoad.of([seq.request.params for seq in seqs]), len(seqs)
        share = [self.prices.batch(size, n, load) / size for n in range(self.max_k + 1)]
        chosen = [self._choose(seq, k, share) for seq in seqs]
        rows = self._batch_width(seqs, chosen, k, load)
        self.chosen = [name for name, _ in rows]
        return [drafts for _, drafts in rows]

    def _batch_width(
        self, seqs: list[Sequence], rows: list[Row], k: int, load: SamplerLoad
    ) -> list[Row]:
        """The rows' free drafts cut to the batch's width: every row verifies as many
        positions as the widest (the others' padded), so that one request's long draft costs
        the whole batch, which a row's own price does not see (at 16 requests, SmolLM2's
        chats at temperature 1 ran at 0.58x plain decoding). Where the model drafts, the
        width is its k, which the cost model chose for the batch; else the width of the most
        expected tokens a second of the batch's step."""
        if any(drafts is None for _, drafts in rows):
            return [_cut(row, k) for row in rows]
        lengths = [len(drafts or []) for _, drafts in rows]
        if len(rows) == 1 or max(lengths) == 0:
            return rows
        rates = [
            seq.request.free_rates[name].rate if name else 0.0
            for seq, (name, _) in zip(seqs, rows, strict=True)
        ]

        def speed(width: int) -> float:
            pairs = zip(rates, lengths, strict=True)
            tokens = sum(expected_tokens(rate, min(n, width)) for rate, n in pairs)
            return tokens / self.prices.batch(len(rows), width, load)

        width = max(range(max(lengths) + 1), key=speed)  # the narrowest of equal speeds
        return [_cut(row, width) for row in rows]

    def _choose(self, seq: Sequence, k: int, share: list[float]) -> Row:
        """(who drafts the sequence's row, its drafts: None for the model's); share[n]: the
        row's share of the step with n free drafts a row."""
        request = seq.request
        named = request.params.speculative_method or "auto"
        free = self.free_drafts(request)
        if named in free:
            return named, free[named]()
        model = k > 0 and self.with_model
        if named != "auto":  # the model, or none
            return (self.model_name, None) if named != "none" and model else (NONE, [])
        load = SamplerLoad.of([request.params])
        trying = request.acceptance.steps < TRY_MODEL_STEPS
        if model and trying and self._cheap_catch_up(seq, k, load):
            return self.model_name, None
        # leaving a model that is caught up (for nothing or a lookup) costs one more of its
        # forwards later: the lazy refill skips this step's tokens, a catch-up runs them
        caught_up = self.lazy_refill and seq.draft_from is None
        switch = self.prices.catch_up(1) if model and caught_up else 0.0
        prices = [seconds + switch for seconds in share]
        # at an equal speed, the option first in this order: nothing, then the drafts that
        # cost no model forward
        best: tuple[float, str, list[int] | None] = (1 / prices[0], NONE, [])
        model_speed = self._model_speed(seq, k, load) if model else 0.0
        for name, propose in free.items():
            estimate = request.free_rates[name]
            _, bound = best_length(estimate.rate, self.max_k, prices)
            if bound <= best[0] or bound < model_speed:  # not even a full draft would win
                continue
            tokens = propose()
            n, speed = best_length(estimate.rate, len(tokens), prices)
            best = max(best, (speed, name, tokens[:n]), key=_speed)
        if model:
            best = max(best, (model_speed, self.model_name, None), key=_speed)
        _, name, drafts = best
        return (name if drafts != [] else NONE), drafts

    def _cheap_catch_up(self, seq: Sequence, k: int, load: SamplerLoad) -> bool:
        """Whether the model's catch-up on the sequence costs no more than its tried steps."""
        return self.prices.catch_up(_lag(seq)) <= TRY_MODEL_STEPS * self.prices.model(k, load)

    def _model_speed(self, seq: Sequence, k: int, load: SamplerLoad) -> float:
        """The model's expected tokens a second of a step, its catch-up's forward spread over
        the steps the request has left."""
        tokens = expected_tokens(seq.request.acceptance.rate, k)
        lag = _lag(seq)
        left = seq.request.params.max_tokens - len(seq.request.output_ids)
        catch_up = self.prices.catch_up(lag) * tokens / max(left, 1) if lag else 0.0
        return tokens / (self.prices.model(k, load) + catch_up)

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        self.model.prefill(plan, dev, out, verdict)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        """The model's drafts, the host's in the rows that have them (a host draft is a point
        mass, which a sampled batch's q says row by row)."""
        chosen = plan.drafted_by or ()
        if self.model_name not in chosen:
            return Drafts(dev.host_drafts)
        drafts = self.model.propose(plan, dev)
        if all(by in (self.model_name, NONE) for by in chosen):
            return drafts  # no host draft to put in (a sampled q's point masses cost [B, k, V])
        return with_host_drafts(drafts, dev.host_drafts)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        return self.model.refill(plan, dev, out, verdict)

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        return self.model.plan_catch_up(seqs, drafting, budget)

    def probe(self, num_tokens: int) -> None:
        self.model.probe(num_tokens)


Row = tuple[str, list[int] | None]  # who drafts a row, and its drafts (None: the model's)


def _cut(row: Row, width: int) -> Row:
    """A row's free drafts cut to the width (none left: it drafts nothing)."""
    name, drafts = row
    if drafts is None or len(drafts) <= width:
        return row
    return (name, drafts[:width]) if width else (NONE, [])


def _speed(option: tuple[float, str, list[int] | None]) -> float:
    return option[0]


def _lag(seq: Sequence) -> int:
    """Tokens the draft model lacks for the sequence (its KV written up to draft_from)."""
    return seq.num_tokens - seq.draft_from if seq.draft_from is not None else 0
