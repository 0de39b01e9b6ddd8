"""Logits processing: a request's bias, penalties, grammar mask, temperature, top-k, top-p
and min-p turn logits into the distributions the acceptance rules compare.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from core.params import SamplingTensors
from models import native
from models.attention import cast


def add_logit_bias(logits: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """logits [B, ..., V] plus each row's bias [B, V'] over the first min(V, V') ids (a drafter's
    vocabulary may be padded, or be the target's prefix)."""
    if bias is None:
        return logits
    width = min(logits.shape[-1], bias.shape[-1])
    row = bias[:, :width].view(bias.shape[0], *[1] * (logits.dim() - 2), width)
    head = logits[..., :width] + row.to(logits.dtype)
    return head if width == logits.shape[-1] else torch.cat([head, logits[..., width:]], -1)


@dataclass
class PenaltyState:
    """What the penalties count, per row: token counts of the output so far and which tokens
    the prompt holds."""

    output_counts: torch.Tensor  # [B, V] float32 (whole numbers)
    prompt_mask: torch.Tensor  # [B, V] bool

    @classmethod
    def build(
        cls,
        prompts: list[list[int]],
        outputs: list[list[int]],
        vocab_size: int,
        device: torch.device | str,
    ) -> PenaltyState:
        def rows_and_ids(seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
            rows = [i for i, ids in enumerate(seqs) for _ in ids]
            flat = [t for ids in seqs for t in ids]
            as_tensor = lambda x: torch.tensor(x, dtype=torch.int64, device=device)
            return as_tensor(rows), as_tensor(flat)

        shape = (len(prompts), vocab_size)
        counts = torch.zeros(shape, dtype=torch.float32, device=device)
        rows, ids = rows_and_ids(outputs)
        counts.index_put_((rows, ids), torch.ones_like(ids, dtype=torch.float32), accumulate=True)
        prompt_mask = torch.zeros(shape, dtype=torch.bool, device=device)
        rows, ids = rows_and_ids(prompts)
        prompt_mask[rows, ids] = True
        return cls(counts, prompt_mask)


def mask_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """logits [B, S, V'] at -inf where the grammar's `allowed` [B, S, V] bool is False: over the
    first min(V, V') ids as it says, and always past V (a drafter's padded vocabulary)."""
    if allowed is None:
        return logits
    width = min(logits.shape[-1], allowed.shape[-1])
    keep = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)
    keep[..., :width] = allowed[..., :width].to(logits.device)
    return logits.masked_fill(~keep, float("-inf"))


def process_logits(
    logits: torch.Tensor,
    st: SamplingTensors,
    penalties: PenaltyState | None = None,
    draft_tokens: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """Target (or drafter) logits -> the distributions the acceptance rules compare.

    logits: [B, S, V]; draft_tokens: [B, S-1] int64, the tokens before positions 1..S-1
    (-1 for padding); allowed: [B, S, V] bool, a grammar's masks (None: no grammar). Returns
    probabilities [B, S, V] (float32, or float64 for float64 logits) after, in this order:
    penalties (position j counts the output so far plus draft tokens 0..j-1, so that verifying
    k drafts sees what k plain steps would see), logit bias, the grammar's mask, temperature,
    top-k (ties with the k-th kept), top-p, min-p. Greedy rows are one-hot at the argmax of the
    penalised, biased, masked logits.
    """
    logits = adjusted_logits(logits, st, penalties, draft_tokens, allowed)
    vocab = logits.shape[-1]
    if st.all_greedy:
        return _one_hot(native.argmax(logits), vocab, logits.dtype)
    temperature = st.temperature
    if st.any_greedy:
        greedy = temperature == 0  # [B]
        greedy_probs = _one_hot(native.argmax(logits), vocab, logits.dtype)
        temperature = torch.where(greedy, 1.0, temperature)
    logits = logits / temperature[:, None, None]
    if st.any_top_k_or_p:
        logits = _top_k_top_p(logits, st.top_k, st.top_p)
    probs = logits.softmax(-1)
    if st.any_min_p:
        probs = _min_p(probs, st.min_p)
    if st.any_greedy:
        probs = torch.where(greedy[:, None, None], greedy_probs, probs)
    return probs


def adjusted_logits(
    logits: torch.Tensor,
    st: SamplingTensors,
    penalties: PenaltyState | None = None,
    draft_tokens: torch.Tensor | None = None,
    allowed: torch.Tensor | None = None,
) -> torch.Tensor:
    """process_logits' first part: the logits (in at least float32) after the penalties, the
    logit bias and the grammar's mask, whose argmax greedy rows take (an all-greedy batch's
    tokens, without building their one-hot distributions)."""
    logits = cast(logits, torch.promote_types(logits.dtype, torch.float32))
    if penalties is not None and st.any_penalty:
        logits = _apply_penalties(logits, st, penalties, draft_tokens)
    return mask_logits(add_logit_bias(logits, st.logit_bias), allowed)


def _one_hot(tokens: torch.Tensor, vocab: int, dtype: torch.dtype) -> torch.Tensor:
    """[..., V] one-hot of int64 tokens [...] (F.one_hot would build it in int64)."""
    out = torch.zeros(*tokens.shape, vocab, dtype=dtype, device=tokens.device)
    return out.scatter_(-1, tokens[..., None], 1.0)


def _apply_penalties(
    logits: torch.Tensor,  # [B, S, V]
    st: SamplingTensors,
    penalties: PenaltyState,
    draft_tokens: torch.Tensor | None,  # [B, S-1]
) -> torch.Tensor:
    """vLLM's rules: repetition on prompt + output tokens (divide positive logits, multiply
    negative ones), then frequency and presence on output tokens."""
    batch, steps, vocab = logits.shape
    counts = penalties.output_counts[:, None, :].expand(batch, steps, vocab)
    if steps > 1:
        if draft_tokens is None:
            raise ValueError("penalties over several positions need the draft tokens")
        counts = counts + _prefix_counts(draft_tokens, steps, vocab)
    in_output = counts > 0
    seen = in_output | penalties.prompt_mask[:, None, :]
    rep = st.repetition_penalty[:, None, None]
    logits = torch.where(seen, torch.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - st.frequency_penalty[:, None, None] * counts
    return logits - st.presence_penalty[:, None, None] * in_output


def _prefix_counts(draft_tokens: torch.Tensor, steps: int, vocab: int) -> torch.Tensor:
    """[B, S, V]: how often each token occurs among draft tokens 0..j-1, for position j."""
    batch = draft_tokens.shape[0]
    valid = (draft_tokens >= 0).float()[..., None]  # [B, S-1, 1]
    step_counts = torch.zeros(batch, steps, vocab, device=draft_tokens.device)
    # draft token j precedes position j+1
    step_counts[:, 1:].scatter_(2, draft_tokens.clamp(min=0)[..., None], valid)
    return step_counts.cumsum(1)


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask to -inf what top-k, then top-p (the smallest prefix of mass >= top_p), remove.

    One stable sort serves both; rows with top_k = 0 and top_p = 1 are left whole."""
    batch, steps, vocab = logits.shape
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)  # [B]
    kth = ordered.gather(-1, (k - 1).view(batch, 1, 1).expand(batch, steps, 1))
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    probs = ordered.softmax(-1)
    mass_before = probs.cumsum(-1) - probs  # the first token always has 0 before it
    # top_p = 1 must keep the tail whatever cumsum's rounding does
    limit = torch.where(top_p < 1, top_p, float("inf"))[:, None, None]
    ordered = ordered.masked_fill(mass_before >= limit, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, ordered)


def _min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens below min_p times the most likely token's probability; renormalise."""
    floor = min_p[:, None, None] * probs.amax(-1, keepdim=True)
    probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)
