"""The draft-model drafter: a small LLM of the same tokenizer, in lockstep with the target.

Its KV lives at the same page ids as the target's. Invariant between steps: the draft's KV
covers every committed token and `deferred[row]` holds its logits for the next position, so
the first draft token of a step costs no forward.
"""

from __future__ import annotations

import torch

from engine.scheduler import Sequence
from kv.cache import KVCache
from models.attention import AttentionMetadata, TorchPagedAttention
from models.llama import LlamaModel
from stages.draft import Drafts, TargetOutput, Verdict
from stages.plan import DevicePlan, Plan
from stages.sample import SALT_DRAFT, SamplingTensors, process_logits, sample


class DraftModelDrafter:
    uses_hidden = False

    def __init__(self, model: LlamaModel, cache: KVCache, max_rows: int, sampled: bool):
        self.model = model
        self.cache = cache
        self.sampled = sampled
        vocab = model.config.vocab_size
        device = model.embed_tokens.weight.device
        self.deferred = torch.zeros(max_rows, vocab, device=device)  # [rows, V]

    def host_drafts(self, seqs: list[Sequence], k: int) -> list[list[int]] | None:
        return None

    def prefill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        self.model(out.input_ids, dev.positions, self._attention(dev.target_meta))
        emit = dev.emit_index
        if emit.numel():
            # the sampled token goes into the draft's KV too; its logits wait for the decode
            zero = torch.zeros_like(emit)
            self._catch_up(dev, emit, out.input_ids[dev.logits_index[emit]], verdict, zero)

    def propose(self, plan: Plan, dev: DevicePlan) -> Drafts:
        logits = self.deferred[dev.rows]  # [B, V]
        tokens, probs = [], []
        for j in range(plan.k):
            token, q = self._choose(logits, plan.sampling, dev.base + 1 + j)
            tokens.append(token)
            probs.append(q)
            if j + 1 < plan.k:
                logits = self._forward(
                    dev,
                    None,
                    token[:, None],
                    (dev.base + 1 + j)[:, None],
                    dev.tail_slots[:, j + 1 : j + 2],
                )[:, 0]
        return Drafts(torch.stack(tokens, 1), torch.stack(probs, 1) if self.sampled else None)

    def refill(self, plan: Plan, dev: DevicePlan, out: TargetOutput, verdict: Verdict) -> None:
        inputs = out.input_ids.view(plan.batch_size, plan.width)
        last_input = inputs.gather(1, verdict.num_accepted[:, None]).squeeze(1)
        self._catch_up(dev, None, last_input, verdict, verdict.num_accepted)

    def _catch_up(self, dev, index, last_input, verdict, accepted) -> None:
        """Run the draft over the last accepted input and the emitted token (positions
        base + a and base + a + 1); rewriting the first is harmless and keeps shapes fixed."""
        pick = (lambda t: t) if index is None else (lambda t: t[index])
        a = accepted
        emitted = pick(verdict.tokens).gather(1, a[:, None]).squeeze(1)
        ids = torch.stack([last_input, emitted], 1)  # [E, 2]
        positions = pick(dev.base)[:, None] + a[:, None] + torch.arange(2, device=a.device)
        slots = pick(dev.tail_slots).gather(1, torch.stack([a, a + 1], 1))
        logits = self._forward(dev, index, ids, positions, slots)
        self.deferred[pick(dev.rows)] = logits[:, 1]

    def _choose(self, logits: torch.Tensor, st: SamplingTensors, position: torch.Tensor):
        if not self.sampled:
            return logits.argmax(-1), None
        q = process_logits(logits[:, None], st, None, None)[:, 0]
        return sample(q, st.seeds, position, SALT_DRAFT), q

    def _forward(self, dev, index, ids, positions, slots) -> torch.Tensor:
        """Draft logits [E, m, V] for m tokens per sequence (ids, positions, slots [E, m])."""
        e, m = ids.shape
        meta = dev.target_meta
        kv_slots = meta.kv_slots if index is None else meta.kv_slots[index]
        kv_lens = meta.kv_lens if index is None else meta.kv_lens[index]
        small = AttentionMetadata(
            slot_mapping=slots.flatten(),
            kv_slots=kv_slots,
            kv_lens=kv_lens,
            q_index=torch.arange(e * m, device=ids.device),
            q_positions=positions,
        )
        hidden, _ = self.model(ids.flatten(), positions.flatten(), self._attention(small))
        return self.model.logits(hidden).view(e, m, -1)

    def _attention(self, meta: AttentionMetadata) -> TorchPagedAttention:
        return TorchPagedAttention(meta, self.cache, self.model.config.num_heads)
