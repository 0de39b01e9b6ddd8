"""Draft: the drafter proposes tokens. The seam every drafter implements, and the simple ones."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import torch

from core.params import SamplingTensors
from core.step import CatchUp, DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from models import native
from models.attention import CausalAttention
from models.graphs import in_whole_step
from stages.grammar import DraftWalk, GrammarWalk
from stages.logits import add_logit_bias, mask_logits, process_logits
from stages.rng import SALT_DRAFT, coupling_noise, perturbed_argmax, uniform
from stages.sampling import draw


def choose_drafts(
    logits: torch.Tensor,  # [B, V] drafter logits
    st: SamplingTensors,
    u: torch.Tensor | None,  # [B] the draft's uniforms; None: greedy drafting
    noise: torch.Tensor | None = None,  # [B, >= V] the coupling's noise at the draft's position
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B], q [B, V] or None): the argmax (a point mass), or a draw from the processed
    q, which the sampler then needs whole for the residual; coupled rows (given `noise`) take
    q's Gumbel-max token, the coupling's guess at the target's."""
    if u is None:  # the bias, so that a biased target still accepts these drafts
        return native.argmax(add_logit_bias(logits, st.logit_bias)), None
    q = process_logits(logits[:, None], st)[:, 0]
    tokens = draw(q, u)
    if noise is not None and st.coupled is not None:
        tokens = torch.where(st.coupled, perturbed_argmax(q, noise), tokens)
    return tokens, q


def draft_chain(
    plan: Plan,
    dev: DevicePlan,
    logits: torch.Tensor,  # [B, V] the drafter's deferred logits for position base + 1
    state: Any,
    step: Callable[[torch.Tensor, Any, int], tuple[torch.Tensor, Any]],
    sampled: bool,
    grammar_aware: bool = True,
) -> Drafts:
    """plan.k draft tokens, each chosen from the drafter's current logits; between tokens,
    `step(token [B], state, j)` runs the drafter over draft j and returns its next logits and
    state (what a head feeds back: its hidden state; nothing for a draft model). A greedy
    batch's q would be the argmax's point mass anyway, so it drafts greedily. Requests with a
    grammar draft from q masked by it, when `grammar_aware` (no draft is spent on a token the
    target's masked law cannot accept; where one token is allowed, q and p are both its point
    mass); otherwise the sampler rejects a forbidden draft."""
    st, k = dev.sampling, plan.k
    walk = GrammarWalk.of(plan.seqs) if grammar_aware else None
    grammar = DraftWalk(walk) if walk is not None else None
    u = noise = None  # [B, k] the drafts' uniforms, drawn at once (positions base + 1 ..)
    if sampled and not st.all_greedy:
        positions = dev.base[:, None] + 1 + torch.arange(k + 1, device=dev.base.device)
        u = uniform(st.seeds, positions[:, :k], SALT_DRAFT)
        if st.coupled is not None:  # the sampler reuses it, bonus position included
            noise = coupling_noise(st.seeds, positions, logits.shape[-1], st.coupled)
    tokens: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for j in range(k):
        u_j = None if u is None else u[:, j]
        if grammar is not None:
            logits = grammar_masked(logits, grammar.allowed())
        token, q = choose_drafts(logits, st, u_j, None if noise is None else noise[:, j])
        tokens.append(token)
        if q is not None:
            probs.append(q)
        if grammar is not None:
            grammar.advance(token.tolist())
        if j + 1 < k:
            logits, state = step(token, state, j)
    if grammar is not None:
        grammar.undo()
    stacked = torch.stack(probs, 1) if probs else None
    return Drafts(torch.stack(tokens, 1), stacked, noise=noise)


def with_host_drafts(drafts: Drafts, host_drafts: torch.Tensor) -> Drafts:
    """A model's drafts [B, k] with the host's (host_drafts [B, k], -1 where none) in the rows
    that have them: a host draft is a point mass, which a sampled batch's q says row by row."""
    host = host_drafts[:, :1] >= 0  # [B, 1]: the host drafted this row
    tokens = torch.where(host, host_drafts, drafts.tokens)
    probs = drafts.probs
    if probs is not None:
        point = torch.nn.functional.one_hot(tokens.clamp(min=0), probs.shape[-1])
        probs = torch.where(host[..., None], point.to(probs.dtype), probs)
    return dataclasses.replace(drafts, tokens=tokens, probs=probs)


def grammar_masked(logits: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Drafter logits [..., V] masked by the grammar; a row the mask leaves empty (a drafter's
    reduced vocabulary holds no allowed token) keeps its own, whose draft the sampler rejects."""
    shape = logits.shape
    flat, mask = logits.reshape(-1, shape[-1]), allowed.reshape(-1, shape[-1])
    masked = mask_logits(flat[:, None], mask[:, None])[:, 0]
    empty = torch.isneginf(masked).all(-1, keepdim=True)  # [N, 1]
    return torch.where(empty, flat, masked).view(shape)


def refill_columns(num_accepted: torch.Tensor, width: int) -> int:
    """How many of a refill's `width` columns (one per verified position, from the step's
    first) to run: up to the longest accepted prefix and the emitted token after it; the
    columns past it lie past the committed length, where nothing reads them before the next
    step rewrites them. On the CPU the accepted counts are already on the host, so the
    refill skips those columns; an accelerator runs them all (fixed shapes, no sync), and so
    does a step run as one graph."""
    if num_accepted.device.type != "cpu" or in_whole_step():
        return width
    return min(width, int(num_accepted.max()) + 1)


def probe_head(head: Any, num_tokens: int) -> None:
    """Time-probe of an EAGLE or MTP head: forward(ids, hidden, positions, attn), then logits."""
    weight = head.target.norm.weight  # the target's device and dtype
    ids = torch.zeros(num_tokens, dtype=torch.long, device=weight.device)
    hidden = torch.zeros(num_tokens, head.config.hidden_size, dtype=weight.dtype, device=ids.device)
    head.logits(head(ids, hidden, ids, CausalAttention(num_tokens, 1)))


class Drafter(Protocol):
    """Proposes draft tokens. Chosen once at start-up; the engine never asks which one it is.

    `host_drafts` proposes on the host at plan time: a row's tokens, None where `propose`
    drafts it on the device; None for the whole batch where the device drafts every row.
    Device work (`prefill`, `propose`, `refill`) runs on the compute stream, in step order.
    `prefill` sees a prefill step: it writes the drafter's KV for the prompt chunk and defers
    its outputs for the first decode. `propose` drafts from the deferred outputs, so its first
    token costs no forward. `refill` runs after sampling: it brings the drafter's KV up to the
    committed tokens and defers its next outputs; it returns how many tokens per sequence its
    forward ran over (0: none), which the step timeline records.
    """

    target_layers: tuple[int, ...]  # target layers whose outputs it reads (TargetOutput.aux)
    # under tensor parallelism: it runs on the leader rank only, whose drafts the step's
    # broadcast carries (a draft model); else every rank drafts with its slice of the head
    leader_only: bool
    # a step it drafts no row of (k = 0, or every row drafted on the host) skips `refill`
    # (Plan.drafter_refill), and its next `propose` or `refill` first runs over the committed
    # tokens whose KV it lacks (Plan.catch_up): a drafter that reads nothing but tokens (a
    # draft model) can, a head (it reads the target's features) cannot
    lazy_refill: bool
    # after `host_drafts`: who drafted each row, where a policy chose among several drafters
    # (Plan.drafted_by); None for a drafter that is one
    chosen: list[str] | None

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None: ...

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None: ...

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts: ...

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int: ...

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        """What a lazy drafter runs over before a decode step in which the model drafts the
        rows `drafting` [B] marks: at most `budget` tokens in all, the rows it drafts first
        (None: nothing to catch up, or a drafter that never lags)."""
        ...

    def probe(self, num_tokens: int) -> None:
        """One forward of the drafter's network over `num_tokens` dummy tokens, outputs
        included, touching no KV (the cost model times it); nothing without a network."""
        ...


class NoDrafter:
    """Plain decoding: proposes nothing."""

    target_layers: tuple[int, ...] = ()
    leader_only = False
    lazy_refill = False
    chosen: list[str] | None = None

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        pass

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        return Drafts(dev.host_drafts)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        return 0

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        return None

    def probe(self, num_tokens: int) -> None:
        pass


class LeaderDrafts(NoDrafter):
    """A tensor-parallel follower's draft model: it runs on the leader only, and the drafts
    arrive with the step's plan (engine/parallel.py)."""

    leader_only = True

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        raise RuntimeError("a draft model's drafts come with the leader's plan")


class GrammarDrafter(NoDrafter):
    """No model: a request's drafts are what its grammar implies (the tokens it forces, the
    usual spelling of the strings it forces), added at plan time (engine/planner.py,
    stages/grammar.py host_drafts); requests without a grammar decode plainly."""

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        return [[] for _ in seqs]


class NgramDrafter(NoDrafter):
    """Prompt lookup: match the context's last n tokens earlier in the context, propose what
    followed. Costs no model; proposes on the host at plan time (the host knows every token in
    speculative mode)."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        return [ngram_lookup(s.request.all_ids, k, self.min_n, self.max_n) for s in seqs]


def ngram_lookup(ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the most recent earlier match of the longest suffix."""
    for n in range(min(max_n, len(ids) - 1), min_n - 1, -1):
        suffix = ids[-n:]
        for start in range(len(ids) - n - 1, -1, -1):
            if ids[start : start + n] == suffix:
                return ids[start + n : start + n + k]
    return []
