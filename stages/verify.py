"""Verify: one target forward over each sequence's last committed token and its drafts."""

from __future__ import annotations

import torch

from kv.cache import KVCache
from models.attention import TorchPagedAttention
from models.llama import LlamaModel
from stages.draft import Drafts, TargetOutput
from stages.history import TokenHistory
from stages.plan import DevicePlan, Plan


class Verifier:
    def __init__(self, model: LlamaModel, cache: KVCache, history: TokenHistory):
        self.model = model
        self.cache = cache
        self.history = history

    def __call__(self, plan: Plan, dev: DevicePlan, drafts: Drafts) -> TargetOutput:
        if plan.kind == "prefill":
            ids = dev.input_ids
            self.history.write_prompt(dev.token_rows, dev.positions, ids)
        else:
            ids = self._decode_inputs(dev, drafts)
        attn = TorchPagedAttention(dev.target_meta, self.cache, self.model.config.num_heads)
        hidden, _ = self.model(ids, dev.positions, attn)
        logits = self.model.logits(hidden[dev.logits_index])
        return TargetOutput(ids, hidden, logits.view(plan.batch_size, plan.width, -1))

    def _decode_inputs(self, dev: DevicePlan, drafts: Drafts) -> torch.Tensor:
        """[B * (k + 1)]: each sequence's last committed token (read on the device), then its
        drafts (padding drafts run too; the sampler ignores them)."""
        last = self.history.at(dev.rows, dev.base)[:, None]
        return torch.cat([last, drafts.tokens.clamp(min=0)], dim=1).flatten()
