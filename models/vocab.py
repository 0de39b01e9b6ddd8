"""A draft vocabulary: a drafter's logits over the tokens it is likely to need, not all.

A draft model's lm_head over Qwen2.5's 151,936 tokens is a quarter of the 0.5B model's bytes,
read at every draft token. Over a draft vocabulary (EAGLE-3's idea) the head reads only its
rows; the other tokens' logits are -inf, so drafts and their q stay inside it. Lossless: the
target verifies every draft, and a q that is 0 outside the vocabulary is a distribution like
any other to the acceptance rules (the sampler then draws the target's tokens there from
the residual).

The vocabulary: every token of a corpus (Python's own library, every other module: code, its
comments and docstrings) by frequency, then the lowest ids not yet in (a byte-level BPE
numbers its merges in the order it learnt them, the most frequent pairs first), and every
special token, up to `size`.
"""

from __future__ import annotations

import collections
import sysconfig
from pathlib import Path

import torch
from torch import nn

from models.tokenizer import Tokenizer

CORPUS_MODULES = 200  # of Python's library, every other one in name order
CORPUS_CHARS = 50_000  # at most, of each


def frequent_ids(tokenizer: Tokenizer, vocab_size: int, size: int) -> torch.Tensor:
    """[size] sorted token ids: the draft vocabulary (all of them where size >= vocab_size)."""
    if size >= vocab_size:
        return torch.arange(vocab_size)
    counts: collections.Counter[int] = collections.Counter()
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[::2][:CORPUS_MODULES]:
        text = path.read_text(errors="replace")[:CORPUS_CHARS]
        counts.update(tokenizer.encode(text, add_special_tokens=False))
    kept = dict.fromkeys(i for i in tokenizer.specials.values() if i < vocab_size)
    kept |= dict.fromkeys(i for i, _ in counts.most_common() if i < vocab_size)
    ids = list(kept)[:size]
    lowest = (i for i in range(vocab_size) if i not in kept)
    ids += [next(lowest) for _ in range(size - len(ids))]
    return torch.tensor(sorted(ids))


class ReducedHead(nn.Module):
    """An lm_head over a draft vocabulary: `head` gives the logits of `ids` [n] (its rows are
    theirs, in order); every other token's is -inf."""

    def __init__(self, head: nn.Module, ids: torch.Tensor, vocab_size: int):
        super().__init__()
        self.head = head
        self.vocab_size = vocab_size
        self.register_buffer("ids", ids, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        small = self.head(x)
        out = small.new_full((*small.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, small)


def float_rows(head: nn.Module, ids: torch.Tensor) -> nn.Module | None:
    """A float lm_head's rows `ids` as a head of their own; None where it holds no float
    weight (a quantized one: models/gguf.py head_rows)."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return None
    rows = nn.Linear(
        weight.shape[1], len(ids), bias=False, device=weight.device, dtype=weight.dtype
    )
    rows.weight = nn.Parameter(weight.detach()[ids.to(weight.device)].clone(), requires_grad=False)
    return rows
