"""Token streams cut into random training windows.

Each split is tokenised once into one uint16 array, every document preceded by
`<|endoftext|>`, and cached as a .npy file in the run directory (read back memory-mapped).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tokenizers import Tokenizer

from train.bpe import eos_id


def tokenize_documents(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """[N] uint16: `<|endoftext|> doc <|endoftext|> doc ...`."""
    if tok.get_vocab_size() > 2**16:
        raise ValueError("uint16 token storage needs a vocabulary of at most 65536")
    eos = eos_id(tok)
    pieces = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        pieces.append(np.array([eos] + enc.ids, dtype=np.uint16))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.uint16)


def cached_tokens(path: Path, tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """The tokenised split, from `path` when present; the cache belongs to one tokenizer."""
    if not path.exists():
        tmp = path.with_suffix(".tmp.npy")
        np.save(tmp, tokenize_documents(tok, texts))
        tmp.rename(path)
    return np.load(path, mmap_mode="r")


class WindowSampler:
    """Random windows of seq + 1 tokens (inputs and shifted labels), from a seeded generator.

    The generator's state travels in checkpoints, so a resumed run draws the same batches.
    """

    def __init__(self, tokens: np.ndarray, batch: int, seq: int, seed: int):
        if len(tokens) <= seq + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of {seq + 1}")
        self.tokens, self.batch, self.seq = tokens, batch, seq
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:
        """[batch, seq + 1] int64."""
        starts = self.rng.integers(0, len(self.tokens) - self.seq - 1, size=self.batch)
        rows = [np.asarray(self.tokens[s : s + self.seq + 1], dtype=np.int64) for s in starts]
        return torch.from_numpy(np.stack(rows))

    def state(self) -> dict:
        return dict(self.rng.bit_generator.state)

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def fixed_windows(tokens: np.ndarray, count: int, seq: int) -> torch.Tensor:
    """[n, seq + 1] int64: up to `count` evenly spaced, non-overlapping windows (evaluation)."""
    n = min(count, (len(tokens) - 1) // seq)
    stride = (len(tokens) - seq - 1) // max(n - 1, 1)
    rows = [np.asarray(tokens[i * stride : i * stride + seq + 1], dtype=np.int64) for i in range(n)]
    return torch.from_numpy(np.stack(rows))
