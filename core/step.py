"""A step's plain types: who runs (Sequence, Batch), what the host decided (Plan), what the
device was given (DevicePlan), and what each device stage hands the next (Drafts,
TargetOutput, Verdict) until the host reads the outcome (Outcome)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from core.attention_metadata import AttentionMetadata
from core.params import SamplingTensors
from core.request import Request


class StepKind(enum.StrEnum):
    PREFILL = "prefill"  # prompt chunks of newly admitted requests
    DECODE = "decode"  # every running request: one token, or one speculative draft, each


class PageTable(Protocol):
    """A sequence's KV pages, as the layers above the cache read them (kv.table.PageTable)."""

    page_size: int
    pages: list[int]

    def slots(self, start: int, end: int) -> list[int]: ...

    def grow(self, allocator: Any, num_slots: int) -> None: ...

    def truncate(self, allocator: Any, num_slots: int, after_step: int | None = None) -> None: ...


@dataclass
class Sequence:
    """Host-side state of one admitted request, written by the scheduler alone
    (engine/scheduler.py: admission, planning, a step landing, release)."""

    request: Request
    table: PageTable
    row: int  # the request's row in the device's per-request buffers (token history, ...)
    num_prefilled: int = 0  # tokens of `prefill_ids` whose KV is written
    num_tokens: int = 0  # committed tokens as the host knows them (prompt + output)
    num_pending: int = 0  # tokens that in-flight steps will add (plain decoding's look-ahead)
    last_step: int = -1  # the last step that wrote this sequence's KV
    prefill_ids: list[int] = field(default_factory=list)  # prompt (+ output after preemption)
    num_cached: int = 0  # leading tokens of `prefill_ids` found in the prefix cache
    # the first position whose draft-model KV is not written (steps that skipped the drafter's
    # refill: Plan.drafter_refill); None: every committed token's is
    draft_from: int | None = None

    @property
    def prefilling(self) -> bool:
        return self.num_prefilled < len(self.prefill_ids)

    @property
    def planned_tokens(self) -> int:
        return self.num_tokens + self.num_pending


@dataclass
class Batch:
    kind: StepKind
    seqs: list[Sequence]
    chunks: list[int]  # prefill: tokens of each sequence in this step; decode: 0


@dataclass(frozen=True)
class CatchUp:
    """The committed tokens a draft model (Drafter.lazy_refill) runs over before it drafts or
    refills in a step: the prompt whose prefill it deferred, the tokens of the steps whose
    refill it skipped. Each sequence runs `length` of them, its window ending at `end` [B]: at
    its last committed token where the window reaches back to the first token it lacks (a
    sequence that lacks fewer rewrites KV it has), else `length` tokens on from that first one
    (a long lag is caught up in chunks that fit the step's token budget). `lacking` [B]: the
    first position whose draft KV is still not written after the window (None: none is); only
    a sequence with none may be drafted by the model in the step."""

    length: int
    end: list[int]
    lacking: list[int | None]


@dataclass(frozen=True)
class Plan:
    """One step, as decided on the host (stages/pack.py makes it; nothing changes it)."""

    step: int
    kind: StepKind
    seqs: list[Sequence]
    k: int  # draft tokens per sequence (0: no speculation this step)
    num_drafts: list[int]  # [B] per-sequence cap on accepted drafts (<= k)
    base: list[int]  # [B] position of each sequence's last target input token
    emits: list[bool]  # [B] whether the step samples a token for the sequence
    unknown: list[int]  # [B] see DevicePlan.unknown
    page_size: int
    # the batch's sampling parameters on the host (pinned on a GPU); DevicePlan.sampling is
    # the device's copy, made by the step's own stream
    sampling: SamplingTensors
    top_logprobs: int | None  # top-n logprobs wanted by some request of the batch
    fields: dict[str, list[int]]  # the int32 sections uploaded in one buffer, by name
    # False: the drafter's refill is skipped, a lazy drafter's step that drafts no row (k = 0,
    # or a hybrid's rows all drafted by the suffix); it catches up later (Drafter.lazy_refill)
    drafter_refill: bool = True
    # what the draft model runs over before it drafts or refills (None: no sequence lacks KV
    # it needs this step)
    catch_up: CatchUp | None = None
    # [B] the drafter of each sequence's drafts this step, where a policy chose among several
    # (--speculative auto: "model", "ngram", "suffix", "" for none); None: the one drafter
    drafted_by: list[str] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.fields["rows"])  # a tensor-parallel follower has no seqs

    @property
    def width(self) -> int:
        return self.k + 1

    @property
    def max_q(self) -> int:
        return max(_lengths(self.fields["qo_indptr"]), default=1)

    @property
    def max_kv(self) -> int:
        pages = max(_lengths(self.fields["kv_indptr"]), default=1)
        return pages * self.page_size

    @property
    def num_tokens(self) -> int:
        return len(self.fields["positions"])


def _lengths(indptr: list[int]) -> list[int]:
    return [b - a for a, b in zip(indptr, indptr[1:], strict=False)]


@dataclass
class DevicePlan:
    """The step's metadata on the device (unpacked from the uploaded buffer)."""

    rows: torch.Tensor  # [B] each sequence's row in the per-request device buffers
    input_ids: torch.Tensor  # [T] prefill tokens (decode steps gather theirs on the device)
    positions: torch.Tensor  # [T]
    target_meta: AttentionMetadata  # the target forward's attention over T tokens
    logits_index: torch.Tensor  # [B * W] rows of T whose logits are verified (W = k + 1)
    tail_slots: torch.Tensor  # [B, k + 2] slots of positions base .. base + k + 1
    base: torch.Tensor  # [B] position of each sequence's last target input before the draft
    emits: torch.Tensor  # [B] bool: the step samples a token for this sequence
    emit_index: torch.Tensor  # [E] the sequences that emit (all of them in a decode step)
    token_rows: torch.Tensor  # [T] each token's row in the per-request device buffers
    num_drafts: torch.Tensor  # [B] draft tokens allowed per sequence (<= k)
    prompt_lens: torch.Tensor  # [B] output tokens start here (penalties count them)
    host_drafts: torch.Tensor  # [B, k] drafts proposed on the host (n-gram), -1 where none
    unknown: torch.Tensor  # [B] 1: planned before the sequence's previous step was sampled
    # a prefill's prefix-cache hits, whose KV is cached but whose tokens the history lacks
    cached_rows: torch.Tensor  # [C]
    cached_positions: torch.Tensor  # [C]
    cached_ids: torch.Tensor  # [C]
    catch_up_end: torch.Tensor  # [B] each sequence's catch-up window's last position (CatchUp)
    sampling: SamplingTensors  # the batch's sampling parameters, on the device


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
    # [B, D + 1, V] the seeded coupling's noise at positions base + 1 .. base + 1 + D (D: k, or
    # a tree's depth), drawn by the drafter for its own proposals; None: the sampler draws it
    noise: torch.Tensor | None = None


@dataclass
class TargetOutput:
    """The target's verify forward."""

    input_ids: torch.Tensor  # [T] tokens the target ran over
    hidden: torch.Tensor  # [T, H] hidden states after the final norm
    logits: torch.Tensor  # [B, W, V] logits at the verified positions (W = k + 1)
    aux: torch.Tensor | None = None  # [T, n * H] the drafter's target_layers' outputs, side by side


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
    forced: torch.Tensor | None = None  # [B, W] bool: the grammar allowed emitted token j alone


@dataclass
class TopLogprobs:
    """The logprobs a step's requests asked for, on the host."""

    chosen: list[list[float]]  # [B][W] logprob of each emitted token
    top_ids: list[list[list[int]]]  # [B][W][n]
    top: list[list[list[float]]]  # [B][W][n]


@dataclass
class Outcome:
    """A step's verdict on the host: what publishing reads."""

    tokens: list[list[int]]  # [B][W] emitted tokens, -1 past the emitted ones
    emitted: list[int]  # [B]
    accepted: list[int]  # [B]
    logprobs: TopLogprobs | None = None
    forced: list[list[bool]] | None = None  # [B][W] see Verdict.forced

    @classmethod
    def of(cls, verdict: Verdict) -> Outcome:
        """Copies the verdict to the host (it waits for the device)."""
        logprobs = None
        if verdict.logprobs is not None:
            assert verdict.top_ids is not None and verdict.top_logprobs is not None
            logprobs = TopLogprobs(
                verdict.logprobs.tolist(), verdict.top_ids.tolist(), verdict.top_logprobs.tolist()
            )
        forced = None if verdict.forced is None else verdict.forced.tolist()
        return cls(
            verdict.tokens.tolist(),
            verdict.num_emitted.tolist(),
            verdict.num_accepted.tolist(),
            logprobs,
            forced,
        )
