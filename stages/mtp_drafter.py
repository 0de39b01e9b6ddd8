"""The MTP drafter, multi-token mode: a DeepSeek-style head chained k times per step, with the
draft-model scheduling (the host learns the accepted lengths once per step).

Alignment. The head's pair at position p is (t_p, H_{p-1}): the token at p with the target's
hidden state at p - 1, so its KV sits at the target's slot for p and its output predicts
t_{p+1}. Position 0 pairs t_0 with a zero hidden state (a start-of-sequence key; hnorm(0) = 0).
With this convention a prefill chunk runs with exactly the target's attention metadata.

Invariant between steps, for a sequence whose last committed token sits at position n
(`base` of its next decode step): the head's KV covers positions 0..n with pairs built from
the target's hidden states, and `logits[row]`, `hidden[row]` hold the head's output at n
(the prediction of t_{n+1}), so the first draft token of a step costs no forward.
"""

from __future__ import annotations

import torch

from core.attention import AttentionMetadata
from core.step import DevicePlan, Drafts, Plan, Sequence, TargetOutput, Verdict
from kv.cache import KVCache
from models.attention import Attention, AttentionBackend
from models.mtp import MTPHead
from stages.draft import draft_chain, probe_head, refill_columns
from stages.plan import drafter_metadata


class MTPDrafter:
    target_layers: tuple[int, ...] = ()
    leader_only = False  # the head is sharded with the target

    def __init__(
        self,
        head: MTPHead,
        cache: KVCache,
        attention: AttentionBackend,
        max_rows: int,
        sampled: bool,
    ):
        self.head = head
        self.cache = cache
        self.attention = attention
        self.sampled = sampled
        weight = head.enorm.weight  # the head's device and dtype
        size, vocab = head.config.hidden_size, head.config.vocab_size
        self.logits = torch.zeros(max_rows, vocab, device=weight.device)  # [rows, V] deferred
        # deferred head hidden at `base` (block output), fed back for the second draft token
        self.hidden = torch.zeros(max_rows, size, dtype=weight.dtype, device=weight.device)
        # the target's hidden state of a prompt chunk's last token, paired with the first
        # token of the next chunk                                      # [rows, H]
        self.carry = torch.zeros(max_rows, size, dtype=weight.dtype, device=weight.device)

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return None

    def probe(self, num_tokens: int) -> None:
        probe_head(self.head, num_tokens)

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        """Pairs (t_p, H_{p-1}) over the chunk at the target's own positions and slots; for a
        final chunk also (sampled token, H of the last prompt token), whose outputs wait for the
        first decode."""
        meta = dev.target_meta
        first = meta.q_index % meta.max_q == 0  # [T] the chunk's first token
        previous = torch.cat((out.hidden[:1], out.hidden[:-1]))  # [T, H] H_{p-1} within a chunk
        hidden = torch.where(first[:, None], self.carry[dev.token_rows], previous)
        hidden = hidden.masked_fill((dev.positions == 0)[:, None], 0)
        self.head(out.input_ids, hidden, dev.positions, self._attention(meta))
        last = out.hidden[dev.logits_index]  # [B, H] H of each chunk's last token
        self.carry[dev.rows] = last
        emit = dev.emit_index
        if emit.numel():
            token = verdict.tokens[emit, :1]  # [E, 1] sampled token at base + 1
            position = dev.base[emit, None] + 1  # [E, 1]
            slot = dev.tail_slots[emit, 1:2]  # [E, 1]
            h = self._forward(dev, emit, token, last[emit, None], position, slot)[:, 0]
            self._defer(dev.rows[emit], h)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        """Token 1 from the deferred logits; token j + 1 from the head over (token j, the head's
        own hidden state at the previous position)."""

        def step(token: torch.Tensor, hidden: torch.Tensor, j: int):
            position = (dev.base + 1 + j)[:, None]
            slot = dev.tail_slots[:, j + 1 : j + 2]
            hidden = self._forward(dev, None, token[:, None], hidden[:, None], position, slot)
            return self.head.logits(hidden[:, 0]), hidden[:, 0]

        logits, hidden = self.logits[dev.rows], self.hidden[dev.rows]  # [B, V], [B, H]
        return draft_chain(plan, dev, logits, hidden, step, self.sampled)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> int:
        """Rewrite the head's KV over the committed span with the target's hidden states.

        With a accepted, the pairs at positions base+1 .. base+a+1 are (d_1, H_base), ...,
        (d_a, H_{base+a-1}), (x, H_{base+a}) with x the emitted token. The first m pairs run
        (`refill_columns`: at most k + 1; the drafts past a, and x in place of d_{a+1}); those
        past base+a+1 lie beyond the committed length, where the next step rewrites them
        before reading. The outputs at row a are deferred."""
        b, w = plan.batch_size, plan.width
        a = verdict.num_accepted  # [B]
        m = refill_columns(a, w)
        inputs = out.input_ids.view(b, w)  # [B, k + 1]: last committed token, then drafts
        emitted = verdict.tokens.gather(1, a[:, None])  # [B, 1]
        ids = torch.cat((inputs[:, 1:], inputs[:, :1]), 1).scatter(1, a[:, None], emitted)
        hidden = out.hidden.view(b, w, -1)[:, :m]  # [B, m, H] H_base ..
        positions = dev.base[:, None] + 1 + torch.arange(m, device=a.device)  # [B, m]
        h = self._forward(dev, None, ids[:, :m], hidden, positions, dev.tail_slots[:, 1 : m + 1])
        self._defer(dev.rows, h.gather(1, a[:, None, None].expand(-1, 1, h.shape[-1]))[:, 0])
        return m

    def _defer(self, rows: torch.Tensor, hidden: torch.Tensor) -> None:
        """Keep the head's output at a sequence's last committed position: hidden [R, H]."""
        self.hidden[rows] = hidden
        self.logits[rows] = self.head.logits(hidden).float()

    def _forward(self, dev, index, ids, hidden, positions, slots) -> torch.Tensor:
        """Head block outputs [E, m, H] for m pairs per sequence (ids, positions, slots [E, m],
        hidden [E, m, H]) of the sequences `index` (None: all), attending over the target's key
        slots with their own query positions."""
        e, m = ids.shape
        small = drafter_metadata(dev, index, positions, slots)
        h = self.head(
            ids.flatten(), hidden.flatten(0, 1), positions.flatten(), self._attention(small)
        )
        return h.view(e, m, -1)

    def _attention(self, meta: AttentionMetadata) -> Attention:
        return self.attention(meta, self.cache, self.head.config.num_heads)
