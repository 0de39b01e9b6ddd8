"""Every running request's tokens, kept on the device.

Decode steps read their input tokens here (the host may not know them yet: plain decoding
plans step N+1 before step N is sampled), the sampler counts penalties from here, and the
refill stage commits each step's emitted tokens here.
"""

from __future__ import annotations

import torch


class TokenHistory:
    def __init__(self, max_rows: int, max_len: int, device: torch.device):
        self.tokens = torch.zeros(max_rows, max_len, dtype=torch.long, device=device)  # [R, L]
        # drafts accepted in each row's latest step: where a step planned before that one was
        # sampled must move to (stages/insert.py)
        self.accepted = torch.zeros(max_rows, dtype=torch.long, device=device)  # [R]

    def write_prompt(self, rows: torch.Tensor, positions: torch.Tensor, ids: torch.Tensor) -> None:
        """Prefill tokens ids [T] of rows [T] at positions [T]."""
        self.tokens[rows, positions] = ids

    def commit(
        self,
        rows: torch.Tensor,  # [B]
        first: torch.Tensor,  # [B] position of each row's first emitted token
        tokens: torch.Tensor,  # [B, W] emitted tokens, -1 past the emitted ones
        accepted: torch.Tensor,  # [B] drafts accepted
    ) -> None:
        """Write all W positions without a host sync: what lies past a row's emitted tokens
        is beyond its committed length, never read, and overwritten by later commits."""
        offsets = torch.arange(tokens.shape[1], device=tokens.device)
        self.tokens[rows[:, None], first[:, None] + offsets] = tokens.clamp(min=0)
        self.accepted[rows] = accepted

    def counts(
        self, rows: torch.Tensor, start: torch.Tensor, end: torch.Tensor, vocab: int
    ) -> torch.Tensor:
        """[B, V] how often each token occurs at positions start..end-1 of each row."""
        length = int(self.tokens.shape[1])
        span = torch.arange(length, device=rows.device)
        inside = (span[None, :] >= start[:, None]) & (span[None, :] < end[:, None])
        counts = torch.zeros(rows.shape[0], vocab, device=rows.device)
        return counts.scatter_add_(1, self.tokens[rows], inside.float())
