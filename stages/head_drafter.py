"""The head drafter: one layer over the target's features drafts a chain, top-1 (or a draw) at
each step. One drafter for the three heads: EAGLE-1 and EAGLE-3 (the features are the target's
final hidden states, or its fused middle layers) and DeepSeek's MTP (the final hidden states,
through the head's own norms). Trees over the same heads: stages/tree_drafter.py.

Pairs. The head reads a pair (t_p, f_{p-1}): a token with the feature of the token before. Its
KV sits at the target's slot of the pair's position, p - 1 + `pair_offset`: EAGLE puts the pair
at p - 1 (pair_offset 0; a prompt's token 0 has no pair), MTP at p (pair_offset 1; token 0
pairs with a zero state, a start-of-sequence key). Drafting feeds the head's own output back
as the next pair's feature; refill rewrites those pairs with the target's features of the
tokens it kept.

Invariant between steps, for a sequence whose last committed token sits at `base` (not yet
run by the target): the head's KV holds the pairs of tokens 0 .. base, the last of them being
(t_base, f_{base-1}); `deferred_hidden[row]` is the head's output there and
`deferred_logits[row]` its logits for t_{base+1}, so the first draft token costs no forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from core.attention_metadata import AttentionMetadata
from core.step import CatchUp, DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from kv.cache import KVCache
from models.attention import Attention, AttentionBackend
from models.eagle import Eagle3Head, EagleHead
from models.graphs import Forward
from models.mtp import MTPHead
from stages.draft import draft_chain, probe_head, refill_columns
from stages.pack import drafter_metadata

Head = EagleHead | Eagle3Head | MTPHead


class HeadDrafter:
    leader_only = False  # the head is sharded with the target
    lazy_refill = False
    chosen: list[str] | None = None

    def __init__(
        self,
        head: Head,
        cache: KVCache,  # one layer, indexed by the engine's page ids
        attention: AttentionBackend,
        max_rows: int,
        sampled: bool,
        grammar_aware: bool = True,
        graphs: Callable[[Forward], Forward] | None = None,  # models/graphs.py
    ):
        self.head = head
        self.run = graphs(self.forward) if graphs is not None else self.forward
        self.target_layers = head.target_layers
        self.offset = head.pair_offset
        self.cache = cache
        self.attention = attention
        self.sampled = sampled
        self.grammar_aware = grammar_aware
        weight = head.target.norm.weight  # the target's device and dtype
        h, vocab = weight.shape[0], head.target.config.vocab_size
        self.deferred_logits = torch.zeros(max_rows, vocab, device=weight.device)  # [rows, V]
        self.deferred_hidden = weight.new_zeros(max_rows, h)  # [rows, H] the head's output
        # the target feature of the last token of each row's latest prompt chunk: the next
        # chunk pairs it with its first token
        self.last_feature = weight.new_zeros(max_rows, h)  # [rows, H]
        # the target feature at each page's last position, once committed: a chunk that
        # starts on a page boundary pairs it with its first token (after a prefix-cache hit,
        # the page's only record of it); one row more, which the positions that end no page
        # write (a decode step's writes keep their shapes: no sync, a step's graph holds them)
        self.page_features = weight.new_zeros(cache.num_pages + 1, h)  # [pages + 1, H]

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int] | None] | None:
        return None

    def plan_catch_up(
        self, seqs: list[Sequence], drafting: list[bool], budget: int
    ) -> CatchUp | None:
        return None  # a head reads the target's features: it never lags

    def probe(self, num_tokens: int) -> None:
        probe_head(self.head, num_tokens)

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        """The pairs of the chunk's tokens; a chunk's first token takes its feature from the
        previous chunk (on a page boundary from the page before, which a prefix-cache hit
        brings). For a final chunk also the pair of the sampled token, whose outputs wait for
        the first decode."""
        meta = dev.target_meta
        seq = torch.div(meta.q_index, meta.max_q, rounding_mode="floor")  # [T]
        first = meta.q_index % meta.max_q == 0  # [T] first token of its sequence's chunk
        target = self.head.target_features(out)  # [T, H]
        ps = self.cache.page_size
        ends = (dev.positions + 1) % ps == 0  # [T] a page's last position
        self.page_features[_page(meta.slot_mapping[ends], ps)] = target[ends]
        before = meta.kv_slots[seq, (dev.positions - 1).clamp(min=0)]  # [T] the slot before
        on_boundary = (dev.positions % ps == 0)[:, None]
        carried = torch.where(
            on_boundary, self.page_features[_page(before, ps)], self.last_feature[dev.token_rows]
        )
        previous = torch.roll(target, 1, 0)  # [T, H] the feature of the token before
        features = torch.where(first[:, None], carried, previous)
        features = features.masked_fill((dev.positions == 0)[:, None], 0)  # none before t_0
        shift = 1 - self.offset  # a pair sits `shift` positions before its token
        positions = dev.positions - shift  # [T]
        # EAGLE's token 0 has no pair, and the pair of a prefix-cache hit's first token came
        # with the hit (on a page other requests may hold): their rows write the slot of the
        # chunk's last position, which the next chunk (or the sampled token's pair) rewrites
        # before anything reads it
        hit = first & torch.isin(dev.token_rows, dev.cached_rows) & (shift == 1)
        slots = meta.kv_slots[seq, positions.clamp(min=0)]
        slots = torch.where((positions < 0) | hit, meta.kv_slots[seq, dev.base[seq]], slots)
        pairs = AttentionMetadata(
            slot_mapping=slots,
            kv_slots=meta.kv_slots,
            kv_lens=meta.kv_lens,
            q_index=meta.q_index,
            q_positions=(meta.q_positions - shift).clamp(min=0),
            shared=meta.shared,
        )
        self.head(out.input_ids, features, positions.clamp(min=0), self._attention(pairs))
        self.last_feature[dev.rows] = target[dev.logits_index]
        emit = dev.emit_index
        if emit.numel():  # the sampled token t_{base+1} with f_base
            sampled = verdict.tokens[emit, :1]  # [E, 1]
            feature = target[dev.logits_index[emit]][:, None]  # [E, 1, H]
            position = dev.base[emit][:, None] + self.offset  # [E, 1]
            slot = dev.tail_slots[emit, self.offset : self.offset + 1]
            self._defer(dev, emit, sampled, feature, position, slot, None)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        """Token 1 from the deferred logits; token j + 2 from the head over the pair (token
        j + 1, the head's own output for the pair before)."""

        def step(token: torch.Tensor, feature: torch.Tensor, j: int):
            o = self.offset
            position, slot = (dev.base + o + j)[:, None], dev.tail_slots[:, o + j : o + j + 1]
            feature = self._forward(dev, None, token[:, None], feature[:, None], position, slot)
            return self.head.logits(feature[:, 0]), feature[:, 0]

        logits = self.deferred_logits[dev.rows]  # [B, V]
        feature = self.deferred_hidden[dev.rows]  # [B, H]
        return draft_chain(plan, dev, logits, feature, step, self.sampled, self.grammar_aware)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        """The pairs (emitted token j, the target's feature at base + j) for j < m
        (`refill_columns`: at most k + 1); the columns past a sequence's accepted count lie
        past its committed length, where nothing reads them before the next step rewrites
        them. The outputs at the accepted count are deferred."""
        b, w, o = plan.batch_size, plan.width, self.offset
        m = refill_columns(verdict.num_accepted, w)
        tokens = verdict.tokens[:, :m].clamp(min=0)  # [B, m]
        features = self.head.target_features(out).view(b, w, -1)[:, :m]  # [B, m, H] f_base ..
        positions = dev.base[:, None] + o + torch.arange(m, device=tokens.device)  # [B, m]
        slots = dev.tail_slots[:, o : o + m]
        self._defer(dev, None, tokens, features, positions, slots, verdict.num_accepted)
        self.keep_page_ends(dev, features, verdict.num_accepted)
        return m

    def keep_page_ends(
        self, dev: DevicePlan, features: torch.Tensor, accepted: torch.Tensor
    ) -> None:
        """page_features at the committed positions base .. base + accepted (features
        [B, m, H] of positions base + j) that end a page."""
        m, ps = features.shape[1], self.cache.page_size
        j = torch.arange(m, device=features.device)
        ends = (j <= accepted[:, None]) & ((dev.base[:, None] + j + 1) % ps == 0)  # [B, m]
        nowhere = self.page_features.shape[0] - 1
        pages = torch.where(ends, _page(dev.tail_slots[:, :m], ps), nowhere)  # [B, m]
        self.page_features[pages.flatten()] = features.flatten(0, 1)

    def _defer(self, dev, index, tokens, features, positions, slots, accepted) -> None:
        """Run the head over pairs [E, m] and keep its outputs at column `accepted` (0 if None)
        for the sequences `index` (all if None)."""
        hidden = self._forward(dev, index, tokens, features, positions, slots)  # [E, m, H]
        column = torch.zeros_like(tokens[:, 0]) if accepted is None else accepted  # [E]
        kept = hidden[torch.arange(hidden.shape[0], device=hidden.device), column]  # [E, H]
        rows = dev.rows if index is None else dev.rows[index]
        self.deferred_hidden[rows] = kept
        self.deferred_logits[rows] = self.head.logits(kept).float()

    def _forward(self, dev, index, ids, features, positions, slots) -> torch.Tensor:
        """The head's outputs [E, m, H] for m pairs per sequence (ids, positions, slots [E, m],
        features [E, m, H]) of the sequences `index` (None: all), attending over the keys of
        the step's target metadata."""
        e, m = ids.shape
        small = drafter_metadata(dev, index, positions, slots)
        flat = features.reshape(e * m, -1)
        (hidden,) = self.run(ids.flatten(), positions.flatten(), small, flat)
        return hidden.view(e, m, -1)

    def forward(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        features: torch.Tensor,
    ) -> tuple[torch.Tensor]:
        """The head's outputs [T, H] over pairs (ids [T], features [T, H])."""
        return (self.head(ids, features, positions, self._attention(meta)),)

    def _attention(self, meta: AttentionMetadata) -> Attention:
        return self.attention(meta, self.cache, self.head.config.num_heads)


def _page(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    return torch.div(slots, page_size, rounding_mode="floor")
