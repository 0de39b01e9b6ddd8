"""Refill: commit the emitted tokens and bring the drafter up to them (device work)."""

from __future__ import annotations

from stages.draft import Drafter, TargetOutput, Verdict
from stages.history import TokenHistory
from stages.plan import DevicePlan, Plan


class RefillStage:
    def __init__(self, history: TokenHistory, drafter: Drafter):
        self.history = history
        self.drafter = drafter

    def __call__(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        # The target's KV past the accepted tokens is stale but harmless: it lies past the
        # committed length, which the next step's attention never reads, and is rewritten.
        self.history.commit(dev.rows, dev.base + 1, verdict.tokens)
        if plan.kind == "prefill":
            self.drafter.prefill(plan, dev, out, verdict)
        else:
            self.drafter.refill(plan, dev, out, verdict)
