"""Verify: one target forward over each sequence's last committed token and its drafts."""

from __future__ import annotations

from dataclasses import replace

import torch

from core.step import DevicePlan, Drafts, Plan, StepKind, TargetOutput
from kv.cache import KVCache
from models.attention import AttentionBackend
from models.llama import LlamaModel
from stages.history import TokenHistory


class Verifier:
    def __init__(
        self,
        model: LlamaModel,
        cache: KVCache,
        attention: AttentionBackend,
        history: TokenHistory,
        aux_layers: tuple[int, ...] = (),
    ):
        self.model = model
        self.aux_layers = aux_layers  # the drafter's target_layers
        self.cache = cache
        self.attention = attention
        self.history = history

    def __call__(
        self, plan: Plan, dev: DevicePlan, drafts: Drafts, last_token: torch.Tensor | None
    ) -> TargetOutput:
        """last_token [B]: a decode step's input tokens (stages/insert.py); None in prefill."""
        if plan.kind == StepKind.PREFILL:
            ids = dev.input_ids
            self.history.write_prompt(dev.token_rows, dev.positions, ids)
            self.history.write_prompt(dev.cached_rows, dev.cached_positions, dev.cached_ids)
        else:
            assert last_token is not None
            ids = self._decode_inputs(last_token, drafts)
        meta, positions = dev.target_meta, dev.positions
        if drafts.mask is not None and drafts.positions is not None:
            # a tree: positions by depth, keys by ancestry
            meta = replace(meta, q_positions=drafts.positions, mask=drafts.mask)
            positions = drafts.positions.flatten()
        attn = self.attention(meta, self.cache, self.model.config.num_heads)
        hidden, aux = self.model(ids, positions, attn, self.aux_layers)
        logits = self.model.logits(hidden[dev.logits_index])
        side_by_side = torch.cat(aux, dim=-1) if aux else None
        return TargetOutput(ids, hidden, logits.view(plan.batch_size, plan.width, -1), side_by_side)

    @staticmethod
    def _decode_inputs(last_token: torch.Tensor, drafts: Drafts) -> torch.Tensor:
        """[B * (k + 1)]: each sequence's last committed token, then its drafts (padding
        drafts run too; the sampler ignores them)."""
        return torch.cat([last_token[:, None], drafts.tokens.clamp(min=0)], dim=1).flatten()
