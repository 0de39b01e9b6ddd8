"""Refill: commit the emitted tokens and bring the drafter up to them (device work)."""

from __future__ import annotations

import torch

from kv.cache import KVCache
from stages.draft import Drafter, TargetOutput, Verdict
from stages.history import TokenHistory
from stages.plan import DevicePlan, Plan


class RefillStage:
    def __init__(self, history: TokenHistory, drafter: Drafter):
        self.history = history
        self.drafter = drafter

    def __call__(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        """Tokens a sequence the drafter's refill forward ran over (0 in a prefill step)."""
        # The target's KV past the accepted tokens is stale but harmless: it lies past the
        # committed length, which the next step's attention never reads, and is rewritten.
        self.history.commit(dev.rows, dev.base + 1, verdict.tokens, verdict.num_accepted)
        if plan.kind == "prefill":
            self.drafter.prefill(plan, dev, out, verdict)
            return 0
        return self.drafter.refill(plan, dev, out, verdict)


def move_tree_path(
    cache: KVCache,
    tail_slots: torch.Tensor,  # [B, >= D + 2] slots of positions base, base + 1, ...
    path: torch.Tensor,  # [B, D] accepted tree nodes, -1 padded
    accepted: torch.Tensor,  # [B] accepted count
) -> None:
    """After a tree: node i's KV was written at slot base + 1 + i; the accepted path's j-th
    node moves to base + 1 + j, where its position belongs. The rest of the tree lies past
    the committed length and is overwritten later; its pages stay the sequence's. Fixed
    shapes (no host sync): entries past the accepted count copy a slot onto itself."""
    d = path.shape[1]
    dst = tail_slots[:, 1 : d + 1]  # [B, D]
    src = tail_slots.gather(1, 1 + path.clamp(min=0))  # [B, D] the path's node slots
    src = torch.where(torch.arange(d, device=path.device) < accepted[:, None], src, dst)
    cache.move(src.flatten(), dst.flatten())
