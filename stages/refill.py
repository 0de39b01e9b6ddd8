"""Refill: commit the emitted tokens and bring the drafter up to them (device work)."""

from __future__ import annotations

from core.step import DevicePlan, Plan, StepKind, TargetOutput, Verdict
from stages.draft import Drafter
from stages.history import TokenHistory


class RefillStage:
    def __init__(self, history: TokenHistory, drafter: Drafter):
        self.history = history
        self.drafter = drafter

    def __call__(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        """Tokens a sequence the drafter's refill forward ran over (0 in a prefill step)."""
        # The target's KV past the accepted tokens is stale but harmless: it lies past the
        # committed length, which the next step's attention never reads, and is rewritten.
        self.history.commit(dev.rows, dev.base + 1, verdict.tokens, verdict.num_accepted)
        if plan.kind == StepKind.PREFILL:
            self.drafter.prefill(plan, dev, out, verdict)
            return 0
        return self.drafter.refill(plan, dev, out, verdict)
