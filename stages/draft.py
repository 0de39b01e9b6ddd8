"""Draft: the drafter proposes tokens. The seam every drafter implements, and the simple ones."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from engine.scheduler import Sequence
from stages.plan import DevicePlan, Plan
from stages.sample import SALT_DRAFT, SamplingTensors, process_logits, sample


@dataclass
class Drafts:
    """What a drafter proposes for one step."""

    tokens: torch.Tensor  # [B, k] int64 draft tokens (entries past num_drafts are ignored)
    probs: torch.Tensor | None = None  # [B, k, V] processed q where sampled; None: point masses


@dataclass
class TargetOutput:
    """The target's verify forward."""

    input_ids: torch.Tensor  # [T] tokens the target ran over
    hidden: torch.Tensor  # [T, H] hidden states after the final norm
    logits: torch.Tensor  # [B, W, V] logits at the verified positions (W = k + 1)


@dataclass
class Verdict:
    """The sampler's decision for one step."""

    tokens: torch.Tensor  # [B, W] emitted tokens, -1 past num_emitted
    num_accepted: torch.Tensor  # [B] accepted draft tokens
    num_emitted: torch.Tensor  # [B] tokens emitted (accepted + 1; 0 for a non-final chunk)
    logprobs: torch.Tensor | None = None  # [B, W] logprob of each emitted token
    top_ids: torch.Tensor | None = None  # [B, W, n] the top-n tokens at each position
    top_logprobs: torch.Tensor | None = None  # [B, W, n]


def choose_drafts(
    logits: torch.Tensor,  # [B, V] drafter logits
    st: SamplingTensors,
    positions: torch.Tensor,  # [B] position of the token drafted
    sampled: bool,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B], q [B, V] or None): the argmax (a point mass), or a draw from the processed
    q, which the sampler then needs whole for the residual."""
    if not sampled:
        return logits.argmax(-1), None
    q = process_logits(logits[:, None].float(), st, None, None)[:, 0]
    return sample(q, st.seeds, positions, SALT_DRAFT), q


class Drafter(Protocol):
    """Proposes draft tokens. Chosen once at start-up; the engine never asks which one it is.

    Device work (`prefill`, `propose`, `refill`) runs on the compute stream, in step order.
    `prefill` sees a prefill step: it writes the drafter's KV for the prompt chunk and defers
    its outputs for the first decode. `propose` drafts from the deferred outputs, so its first
    token costs no forward. `refill` runs after sampling: it brings the drafter's KV up to the
    committed tokens and defers its next outputs.
    """

    uses_hidden: bool  # whether the target must keep hidden states for it

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None: ...

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None: ...

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts: ...

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None: ...


class NoDrafter:
    """Plain decoding: proposes nothing."""

    uses_hidden = False

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        pass

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        return Drafts(dev.host_drafts)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        pass


class NgramDrafter(NoDrafter):
    """Prompt lookup: match the context's last n tokens earlier in the context, propose what
    followed. Costs no model; proposes on the host at plan time (the host knows every token in
    speculative mode)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return [ngram_lookup(s.request.all_ids, k, self.min_n, self.max_n) for s in seqs]


def ngram_lookup(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []
