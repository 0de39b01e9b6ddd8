"""The draft-model drafter: a small LLM of the same tokenizer, in lockstep with the target.

Its KV lives at the same page ids as the target's. It costs nothing until it drafts: a
prompt's prefill is deferred, and the steps it drafts no row of (the cost model's k = 0, or
another drafter drafted every row) skip its refill (Drafter.lazy_refill); what it lacks is
caught up from the token history before it next drafts (Plan.catch_up, planned by
`catch_up_window` within the step's token budget, in chunks where it lacks more). Invariant
for a sequence it drafts: the draft's KV covers every committed token and `deferred[row]`
holds its logits for the next position, so the first draft token of a step costs no forward.
Drafting writes the KV of its own drafts; a drafter that `follows_text` (a hybrid's or a
policy's, whose rows another drafter may have drafted) instead rewrites every committed
token's at refill.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.attention_metadata import AttentionMetadata
from core.step import CatchUp, DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from kv.cache import KVCache
from models.attention import Attention, AttentionBackend, probe_attention
from models.graphs import Forward
from models.llama import LlamaModel
from stages.draft import draft_chain, refill_columns
from stages.history import TokenHistory
from stages.pack import drafter_metadata


class DraftModelDrafter:
    target_layers: tuple[int, ...] = ()
    leader_only = True  # too small to gain from sharding
    lazy_refill = True  # its KV needs nothing but the tokens: it catches up from the history
    chosen: list[str] | None = None

    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        attention: AttentionBackend,
        history: TokenHistory,  # the catch-up reads the tokens it lacks here
        max_rows: int,
        sampled: bool,
        grammar_aware: bool = True,
        follows_text: bool = False,
        graphs: Callable[[Forward], Forward] | None = None,  # models/graphs.py
    ):
        self.model = model
        self.run = graphs(self.forward) if graphs is not None else self.forward
        self.cache = cache
        self.attention = attention
        self.sampled = sampled
        self.grammar_aware = grammar_aware
        self.follows_text = follows_text  # refill over every committed token, whoever drafted
        self.history = history
        self._caught_up = -1  # the last step whose catch-up ran
        vocab = model.config.vocab_size
        device = model.norm.weight.device
        self.deferred = torch.zeros(max_rows, vocab, device=device)  # [rows, V]

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        pass  # deferred to the first step that drafts (Plan.catch_up)

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        return catch_up_window(seqs, drafting, budget)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        def step(token: torch.Tensor, state: None, j: int) -> tuple[torch.Tensor, None]:
            position = (dev.base + 1 + j)[:, None]
            slot = dev.tail_slots[:, j + 1 : j + 2]
            return self._forward(dev, None, token[:, None], position, slot), None

        self._catch_up_lag(plan, dev)
        logits = self.deferred[dev.rows]
        return draft_chain(plan, dev, logits, None, step, self.sampled, self.grammar_aware)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        if not plan.drafter_refill:  # it drafted no row: it catches up when it next does
            return 0
        self._catch_up_lag(plan, dev)  # a step it refills in without drafting
        a = verdict.num_accepted
        if self.follows_text:
            return self._follow(plan, dev, verdict)
        last_input = None
        # Drafting fed the draft d_1 .. d_{k-1}: only d_k, when some sequence accepted it (the
        # last of the refill's columns), still lacks its KV; `refill_columns` says whether it
        # is run (on the CPU only when needed, on an accelerator always: fixed shapes)
        if plan.k and refill_columns(a, plan.width) == plan.width:
            last_input = out.input_ids.view(plan.batch_size, plan.width).gather(1, a[:, None])[:, 0]
        return self._catch_up(dev, None, last_input, verdict, a)

    def probe(self, num_tokens: int) -> None:
        ids = torch.zeros(num_tokens, dtype=torch.long, device=self.deferred.device)
        attn = probe_attention(self.attention, self.cache, self.model.config.num_heads, num_tokens)
        hidden, _ = self.model(ids, ids, attn)
        self.model.logits(hidden)

    def _catch_up(
        self,
        dev: DevicePlan,
        index: torch.Tensor | None,  # [E] the sequences taking part (None: all)
        last_input: torch.Tensor | None,  # [E] the last accepted input, where rewritten
        verdict: Verdict,
        accepted: torch.Tensor,  # [E] accepted drafts
    ) -> int:
        """Run the draft over the emitted token (position base + a + 1), after the last accepted
        input (position base + a) when given: for a sequence whose input there already has its
        KV, rewriting it is harmless and keeps shapes fixed. Returns how many tokens per sequence
        it ran over."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        a = accepted[:, None]
        ids = pick(verdict.tokens).gather(1, a)  # [E, 1] the emitted token
        first = 1
        if last_input is not None:
            ids, first = torch.cat((last_input[:, None], ids), 1), 0
        columns = torch.arange(first, 2, device=a.device)
        positions = pick(dev.base)[:, None] + a + columns
        slots = pick(dev.tail_slots).gather(1, a + columns)
        self._defer(pick(dev.rows), self._forward(dev, index, ids, positions, slots))
        return ids.shape[1]

    def _catch_up_lag(self, plan: Plan, dev: DevicePlan) -> None:
        """Once a step, before it drafts or refills: run the draft over each sequence's
        window of m = plan.catch_up.length committed tokens (positions end - m + 1 .. end,
        their ids from the history) and defer the last one's logits. A sequence that lacks
        fewer rewrites KV it has (the same tokens at the same positions), one shorter than m
        repeats its first token (position 0, the same KV written again). Eager: m varies."""
        if plan.catch_up is None or self._caught_up == plan.step:
            return
        self._caught_up = plan.step
        m, end = plan.catch_up.length, dev.catch_up_end
        positions = (end[:, None] + torch.arange(1 - m, 1, device=end.device)).clamp(0)
        ids = self.history.tokens[dev.rows[:, None], positions]
        slots = dev.target_meta.kv_slots.gather(1, positions)
        small = drafter_metadata(dev, None, positions, slots)
        (hidden,) = self.forward(ids.flatten(), positions.flatten(), small)
        self._defer(dev.rows, self.model.logits(hidden.view(*ids.shape, -1)[:, -1]))

    def _follow(self, plan: Plan, dev: DevicePlan, verdict: Verdict) -> int:
        """Run the draft over the step's committed tokens, the accepted drafts and the
        emitted one (positions base + 1 .. base + a + 1), whoever drafted them; the deferred
        logits are the emitted token's. Columns past a row's emitted token write KV past its
        committed length, overwritten before anything reads it."""
        a = verdict.num_accepted
        m = refill_columns(a, plan.width)
        columns = torch.arange(m, device=a.device)
        positions = dev.base[:, None] + 1 + columns
        slots = dev.tail_slots[:, 1 : m + 1]
        ids = verdict.tokens[:, :m].clamp(min=0)  # -1 pads past the emitted token
        self._defer(dev.rows, self._forward(dev, None, ids, positions, slots, a))
        return m

    def _defer(self, rows: torch.Tensor, logits: torch.Tensor) -> None:
        """Keep the draft's logits [E, V] of rows [E] for the next step, in float32 whatever
        the model computes in (a 16-bit model's logits are upcast once, here)."""
        self.deferred[rows] = logits.float()

    def _forward(
        self,
        dev: DevicePlan,
        index: torch.Tensor | None,  # [E] the sequences taking part (None: all)
        ids: torch.Tensor,  # [E, m]
        positions: torch.Tensor,  # [E, m]
        slots: torch.Tensor,  # [E, m]
        at: torch.Tensor | None = None,  # [E] the column whose logits are wanted
    ) -> torch.Tensor:
        """Draft logits [E, V] at column `at` [E] (None: the last) of m tokens per sequence
        (ids, positions, slots [E, m]); the other tokens only write their KV."""
        e, m = ids.shape
        small = drafter_metadata(dev, index, positions, slots)
        (hidden,) = self.run(ids.flatten(), positions.flatten(), small)
        hidden = hidden.view(e, m, -1)
        if at is None:
            return self.model.logits(hidden[:, -1])
        return self.model.logits(hidden[torch.arange(e, device=at.device), at])

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor]:
        """The draft model's hidden states [T, H]."""
        return (self.model(ids, positions, self._attention(meta))[0],)

    def _attention(self, meta: AttentionMetadata) -> Attention:
        return self.attention(meta, self.cache, self.model.config.num_heads)


def catch_up_window(seqs: list[Sequence], drafting: list[bool], budget: int) -> CatchUp | None:
    """The catch-up of a step (CatchUp) in which the model drafts the rows `drafting` marks:
    as long as the longest lag of those rows, at most budget // B tokens a row (one
    rectangular forward); None where none of them lacks KV."""
    lags = [s.num_tokens - s.draft_from if s.draft_from is not None else 0 for s in seqs]
    needed = [lag for lag, d in zip(lags, drafting, strict=True) if d]
    if not any(needed):
        return None
    m = max(1, min(max(needed), budget // len(seqs)))
    end: list[int] = []
    lacking: list[int | None] = []
    for seq, lag in zip(seqs, lags, strict=True):
        if lag <= m:  # the window reaches back to the first position it lacks
            end.append(seq.num_tokens - 1)
            lacking.append(None)
        else:  # a chunk: m tokens on from there
            assert seq.draft_from is not None
            end.append(seq.draft_from + m - 1)
            lacking.append(seq.draft_from + m)
    return CatchUp(m, end, lacking)
