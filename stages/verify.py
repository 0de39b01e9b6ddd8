"""Verify: one target forward over each sequence's last committed token and its drafts."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from core.attention_metadata import AttentionMetadata
from core.step import DevicePlan, Drafts, Plan, StepKind, TargetOutput
from kv.cache import KVCache
from models.attention import AttentionBackend
from models.graphs import Forward
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
        graphs: Callable[[Forward], Forward] | None = None,
    ):
        self.model = model
        self.aux_layers = aux_layers  # the drafter's target_layers
        self.cache = cache
        self.attention = attention
        self.history = history
        # decode steps' forwards: `forward`, or over static buffers (CUDA graphs) around it
        self.run = graphs(self.forward) if graphs is not None else self.forward

    def __call__(
        self, plan: Plan, dev: DevicePlan, drafts: Drafts, last_token: torch.Tensor | None
    ) -> TargetOutput:
        """last_token [B]: a decode step's input tokens (stages/insert.py); None in prefill."""
        meta, positions = dev.target_meta, dev.positions
        if plan.kind == StepKind.PREFILL:
            ids = dev.input_ids
            self.history.write_prompt(dev.token_rows, positions, ids)
            self.history.write_prompt(dev.cached_rows, dev.cached_positions, dev.cached_ids)
            attn = self.attention(meta, self.cache, self.model.config.num_heads)
            hidden, aux = self.model(ids, positions, attn, self.aux_layers)
            logits = self.model.logits(hidden[dev.logits_index])  # each prompt's last row
        else:  # every row is verified
            assert last_token is not None
            ids = self._decode_inputs(last_token, drafts)
            if drafts.mask is not None and drafts.positions is not None:
                # a tree: positions by depth, keys by ancestry
                meta = replace(meta, q_positions=drafts.positions, mask=drafts.mask)
                positions = drafts.positions.flatten()
            hidden, logits, *aux = self.run(ids, positions, meta)
        side_by_side = torch.cat(aux, dim=-1) if aux else None
        return TargetOutput(ids, hidden, logits.view(plan.batch_size, plan.width, -1), side_by_side)

    def forward(
        self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, ...]:
        """The target over a decode step's rows: hidden states, logits and the drafter's
        layers' outputs, every one [T, ...] (what `graphs` captures)."""
        attn = self.attention(meta, self.cache, self.model.config.num_heads)
        hidden, aux = self.model(ids, positions, attn, self.aux_layers)
        return (hidden, self.model.logits(hidden), *aux)

    @staticmethod
    def _decode_inputs(last_token: torch.Tensor, drafts: Drafts) -> torch.Tensor:
        """[B * (k + 1)]: each sequence's last committed token, then its drafts (padding
        drafts run too; the sampler ignores them)."""
        return torch.cat([last_token[:, None], drafts.tokens.clamp(min=0)], dim=1).flatten()
