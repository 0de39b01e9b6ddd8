"""Verify: one target forward over each sequence's last committed token and its drafts."""

from __future__ import annotations

from dataclasses import replace

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
        meta, positions = dev.target_meta, dev.positions
        if drafts.mask is not None and drafts.positions is not None:
            # a tree: positions by depth, keys by ancestry
            meta = replace(meta, q_positions=drafts.positions, mask=drafts.mask)
            positions = drafts.positions.flatten()
        attn = TorchPagedAttention(meta, self.cache, self.model.config.num_heads)
        hidden, _ = self.model(ids, positions, attn)
        logits = self.model.logits(hidden[dev.logits_index])
        return TargetOutput(ids, hidden, logits.view(plan.batch_size, plan.width, -1))

    def _decode_inputs(self, dev: DevicePlan, drafts: Drafts) -> torch.Tensor:
        """[B * (k + 1)]: each sequence's last committed token (the insert kernel's), then its
        drafts (padding drafts run too; the sampler ignores them)."""
        assert dev.last_token is not None
        last = dev.last_token[:, None]
        return torch.cat([last, drafts.tokens.clamp(min=0)], dim=1).flatten()
