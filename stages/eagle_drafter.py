"""The EAGLE drafter (chain): the head drafts from the target's features, top-1 at each step.

Head position i holds the pair (t_{i+1}, f_i) (token i+1, target feature at i) and its KV lives
at the slot of target position i, at the same page ids as the target's. Invariant between
steps, for a sequence whose last committed token t_n is not yet run by the target (base = n):
the head's KV covers the pairs at positions 0 .. n-1, `deferred_hidden[row]` is its feature at
n-1 (its guess of f_n) and `deferred_logits[row]` the logits of t_{n+1}, so the first draft
token costs no forward. Drafting feeds the head's own feature back in place of the target's;
refill rewrites those pairs with the target's features of the tokens it kept.
"""

from __future__ import annotations

import torch

from engine.scheduler import Sequence
from kv.cache import KVCache
from models.attention import AttentionMetadata, TorchPagedAttention
from models.eagle import EagleHead
from stages.draft import Drafts, TargetOutput, Verdict, choose_drafts
from stages.plan import DevicePlan, Plan, drafter_metadata


class EagleDrafter:
    uses_hidden = True

    def __init__(self, head: EagleHead, cache: KVCache, max_rows: int, sampled: bool):
        self.head = head
        self.cache = cache  # one layer, indexed by the engine's page ids
        self.sampled = sampled
        weight = head.target.embed_tokens.weight
        h, vocab = weight.shape[1], head.target.config.vocab_size
        self.deferred_logits = weight.new_zeros(max_rows, vocab)  # [rows, V]
        self.deferred_hidden = weight.new_zeros(max_rows, h)  # [rows, H] head feature at n-1
        # target feature of the last token of each row's latest prompt chunk: the next chunk
        # pairs it with its first token
        self.last_feature = weight.new_zeros(max_rows, h)  # [rows, H]

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        """Pairs (t_p, f_{p-1}) at position p-1 for each chunk token p; the first token of a
        chunk takes f from the previous chunk. A prompt's token 0 has no pair: its forward row
        writes the slot of the chunk's last position, which the next chunk (or, for a final
        chunk, the pair of the sampled token) rewrites before anything reads it."""
        meta = dev.target_meta
        seq = torch.div(meta.q_index, meta.max_q, rounding_mode="floor")  # [T]
        first = meta.q_index % meta.max_q == 0  # [T] first token of its sequence's chunk
        previous = torch.roll(out.hidden, 1, 0)  # [T, H] hidden of the token before
        features = torch.where(first[:, None], self.last_feature[dev.token_rows], previous)
        positions = (dev.positions - 1).clamp(min=0)  # [T]
        slots = meta.kv_slots[seq, positions]
        slots = torch.where(dev.positions == 0, meta.kv_slots[seq, dev.base[seq]], slots)
        pairs = AttentionMetadata(
            slot_mapping=slots,
            kv_slots=meta.kv_slots,
            kv_lens=meta.kv_lens,
            q_index=meta.q_index,
            q_positions=(meta.q_positions - 1).clamp(min=0),
        )
        self.head(out.input_ids, features, positions, self._attention(pairs))
        self.last_feature[dev.rows] = out.hidden[dev.logits_index]
        emit = dev.emit_index
        if emit.numel():
            # the sampled token t_{end} with f_{end-1}: its outputs wait for the first decode
            sampled = verdict.tokens[emit, :1]  # [E, 1]
            feature = out.hidden[dev.logits_index[emit]][:, None]  # [E, 1, H]
            base = dev.base[emit][:, None]  # [E, 1]
            self._defer(dev, emit, sampled, feature, base, dev.tail_slots[emit, :1], None)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        logits = self.deferred_logits[dev.rows]  # [B, V]
        feature = self.deferred_hidden[dev.rows]  # [B, H]
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor] = []
        for j in range(plan.k):
            token, q = choose_drafts(logits, plan.sampling, dev.base + 1 + j, self.sampled)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            if j + 1 < plan.k:
                # pair (d_{j+1}, the head's guess of f_{base+j}) at position base + j
                feature = self._forward(
                    dev,
                    None,
                    token[:, None],
                    feature[:, None],
                    (dev.base + j)[:, None],
                    dev.tail_slots[:, j : j + 1],
                )[:, 0]
                logits = self.head.logits(feature)
        return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if probs else None)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        """Pairs (emitted token j, target feature at base + j) at positions base + j, for all
        j <= k (fixed shapes): the rows past the accepted count a lie past the committed length,
        where nothing reads them before the next step rewrites them. Row a is deferred."""
        b, w = plan.batch_size, plan.width
        tokens = verdict.tokens.clamp(min=0)  # [B, W]
        features = out.hidden.view(b, w, -1)  # [B, W, H] targets' f_base .. f_{base+k}
        positions = dev.base[:, None] + torch.arange(w, device=tokens.device)  # [B, W]
        slots = dev.tail_slots[:, :w]
        self._defer(dev, None, tokens, features, positions, slots, verdict.num_accepted)

    def _defer(self, dev, index, tokens, features, positions, slots, accepted) -> None:
        """Run the head over pairs [E, m] and keep its outputs at column `accepted` (0 if None)
        for the sequences `index` (all if None)."""
        hidden = self._forward(dev, index, tokens, features, positions, slots)  # [E, m, H]
        column = torch.zeros_like(tokens[:, 0]) if accepted is None else accepted  # [E]
        kept = hidden[torch.arange(hidden.shape[0], device=hidden.device), column]  # [E, H]
        rows = dev.rows if index is None else dev.rows[index]
        self.deferred_hidden[rows] = kept
        self.deferred_logits[rows] = self.head.logits(kept)

    def _forward(self, dev, index, ids, features, positions, slots) -> torch.Tensor:
        """Head features [E, m, H] for m pairs per sequence (ids, positions, slots [E, m],
        features [E, m, H]), attending over the keys of the step's target metadata."""
        e, m = ids.shape
        small = drafter_metadata(dev, index, positions, slots)
        flat = features.reshape(e * m, -1)
        hidden = self.head(ids.flatten(), flat, positions.flatten(), self._attention(small))
        return hidden.view(e, m, -1)

    def _attention(self, meta: AttentionMetadata) -> TorchPagedAttention:
        return TorchPagedAttention(meta, self.cache, self.head.config.num_heads)
