"""Draft: the drafter proposes tokens. The seam every drafter implements, and the simple ones."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from engine.scheduler import Sequence
from models.attention import CausalAttention
from stages.plan import DevicePlan, Plan
from stages.sample import (
    SALT_DRAFT,
    SamplingTensors,
    add_logit_bias,
    draw,
    process_logits,
    uniform,
)


@dataclass
class Drafts:
    """What a drafter proposes for one step."""

    tokens: torch.Tensor  # [B, k] int64 draft tokens (entries past num_drafts are ignored)
    # [B, k, V] the processed q each draft was drawn from where sampled; None: point masses
    probs: torch.Tensor | None = None
    # A tree (None for a chain): k nodes, parents before children, -1 tokens never accepted.
    # Node i is verified at position base + its depth and written at slot base + 1 + i.
    parents: torch.Tensor | None = None  # [B, k] int64 parent node, -1: child of the root
    ancestors: torch.Tensor | None = None  # [B, k, k] bool, node j is node i's ancestor or i
    depth: int = 0  # bound on the nodes' depths (children of the root have depth 1)
    depths: torch.Tensor | None = None  # [B, k] int64 each node's depth
    positions: torch.Tensor | None = None  # [B, k + 1] verify positions: root, then nodes
    mask: torch.Tensor | None = None  # [B, k + 1, Lmax] bool, the step's keys each row sees
    siblings: int = 0  # a tree with sampled children (probs given): most children of a node


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
    path: torch.Tensor | None = None  # [B, depth] a tree's accepted nodes, -1 padded


def choose_drafts(
    logits: torch.Tensor,  # [B, V] drafter logits
    st: SamplingTensors,
    u: torch.Tensor | None,  # [B] the draft's uniforms; None: greedy drafting
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(tokens [B], q [B, V] or None): the argmax (a point mass), or a draw from the processed
    q, which the sampler then needs whole for the residual."""
    if u is None:  # the bias, so that a biased target still accepts these drafts
        return add_logit_bias(logits, st.logit_bias).argmax(-1), None
    q = process_logits(logits[:, None], st)[:, 0]
    return draw(q, u), q


def draft_chain(
    plan: Plan,
    dev: DevicePlan,
    logits: torch.Tensor,  # [B, V] the drafter's deferred logits for position base + 1
    state: Any,
    step: Callable[[torch.Tensor, Any, int], tuple[torch.Tensor, Any]],
    sampled: bool,
) -> Drafts:
    """plan.k draft tokens, each chosen from the drafter's current logits; between tokens,
    `step(token [B], state, j)` runs the drafter over draft j and returns its next logits and
    state (what a head feeds back: its hidden state; nothing for a draft model). A greedy
    batch's q would be the argmax's point mass anyway, so it drafts greedily."""
    st, k = plan.sampling, plan.k
    u = None  # [B, k] the drafts' uniforms, drawn at once (positions base + 1 ..)
    if sampled and not st.all_greedy:
        positions = dev.base[:, None] + 1 + torch.arange(k, device=dev.base.device)
        u = uniform(st.seeds, positions, SALT_DRAFT)
    tokens: list[torch.Tensor] = []
    probs: list[torch.Tensor] = []
    for j in range(k):
        token, q = choose_drafts(logits, st, None if u is None else u[:, j])
        tokens.append(token)
        if q is not None:
            probs.append(q)
        if j + 1 < k:
            logits, state = step(token, state, j)
    return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None)


def refill_columns(num_accepted: torch.Tensor, width: int) -> int:
    """How many of a refill's `width` columns (one per verified position, from the step's
    first) to run: up to the longest accepted prefix and the emitted token after it; the
    columns past it lie past the committed length, where nothing reads them before the next
    step rewrites them. On the CPU the accepted counts are already on the host, so the
    refill skips those columns; an accelerator runs them all (fixed shapes, no sync)."""
    if num_accepted.device.type != "cpu":
        return width
    return min(width, int(num_accepted.max()) + 1)


def tree_ancestors(parents: torch.Tensor, depth: int) -> torch.Tensor:
    """[B, N, N] bool, node j is an ancestor of node i or i itself, for parents [B, N] (-1:
    the root) of a tree no deeper than `depth`."""
    n = parents.shape[1]
    eye = torch.eye(n, dtype=torch.bool, device=parents.device).expand(parents.shape[0], n, n)
    ancestors = eye
    for _ in range(depth - 1):  # each round adds one more generation
        above = ancestors.gather(1, parents.clamp(min=0)[..., None].expand(-1, -1, n))
        ancestors = eye | (above & (parents >= 0)[..., None])
    return ancestors


def tree_drafts(dev: DevicePlan, tokens, parents, depths, depth: int, ancestors=None) -> Drafts:
    """A tree's Drafts with what the target's verify forward needs, built on the device.

    tokens, parents, depths: [B, N] (depths from 1); ancestors [B, N, N] when the caller
    knows them (a fixed shape), else found from the parents. Verify row 0 is the root (the last
    committed token, at position base), row 1 + i node i (position base + depth, slot
    base + 1 + i). Every row sees the committed keys 0 .. base; a node also sees the nodes on
    its own path, itself included: keys base + 1 + j for its ancestors j."""
    if ancestors is None:
        ancestors = tree_ancestors(parents, depth)  # [B, N, N]
    b, n = tokens.shape
    zero = torch.zeros_like(depths[:, :1])
    positions = dev.base[:, None] + torch.cat([zero, depths], 1)  # [B, N + 1]
    lmax = dev.target_meta.kv_slots.shape[1]
    keys = torch.arange(lmax, device=tokens.device)
    prefix = keys[None, :] <= dev.base[:, None]  # [B, Lmax]
    node = keys[None, :] - dev.base[:, None] - 1  # [B, Lmax] node index of each key
    in_tree = (node >= 0) & (node < n)
    rows = torch.cat([torch.zeros_like(ancestors[:, :1]), ancestors], 1)  # [B, N + 1, N]
    index = node.clamp(0, n - 1)[:, None, :].expand(b, n + 1, lmax)
    mask = prefix[:, None, :] | (rows.gather(2, index) & in_tree[:, None, :])
    return Drafts(tokens, None, parents, ancestors, depth, depths, positions, mask)


def probe_head(head: Any, num_tokens: int) -> None:
    """Time-probe of an EAGLE or MTP head: forward(ids, hidden, positions, attn), then logits."""
    weight = head.target.embed_tokens.weight
    ids = torch.zeros(num_tokens, dtype=torch.long, device=weight.device)
    hidden = torch.zeros(num_tokens, head.config.hidden_size, dtype=weight.dtype, device=ids.device)
    head.logits(head(ids, hidden, ids, CausalAttention(num_tokens, 1)))


class Drafter(Protocol):
    """Proposes draft tokens. Chosen once at start-up; the engine never asks which one it is.

    Device work (`prefill`, `propose`, `refill`) runs on the compute stream, in step order.
    `prefill` sees a prefill step: it writes the drafter's KV for the prompt chunk and defers
    its outputs for the first decode. `propose` drafts from the deferred outputs, so its first
    token costs no forward. `refill` runs after sampling: it brings the drafter's KV up to the
    committed tokens and defers its next outputs; it returns how many tokens a sequence its
    forward ran over (0: none), which the step timeline records.
    """

    uses_hidden: bool  # whether the target must keep hidden states for it

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None: ...

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None: ...

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts: ...

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int: ...

    def probe(self, num_tokens: int) -> None:
        """One forward of the drafter's network over `num_tokens` dummy tokens, outputs
        included, touching no KV (the cost model times it); nothing without a network."""
        ...


class NoDrafter:
    """Plain decoding: proposes nothing."""

    uses_hidden = False

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        pass

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        return Drafts(dev.host_drafts)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        return 0

    def probe(self, num_tokens: int) -> None:
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
