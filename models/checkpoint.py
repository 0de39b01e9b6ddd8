"""What every checkpoint reader shares: its error, and the placeholders weights load into."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

# what nn.Linear and nn.Embedding initialise their weights with
INITIALISERS = ("kaiming_uniform_", "uniform_", "normal_")


@contextlib.contextmanager
def to_be_loaded() -> Iterator[None]:
    """Modules built inside are placeholders for weights loaded next: on the meta device, not
    initialised (an initialiser of a meta tensor computes nothing, yet imports torch's
    compiler, about 150 MB resident for the life of the process)."""
    saved = {name: getattr(nn.init, name) for name in INITIALISERS}
    try:
        for name in INITIALISERS:
            setattr(nn.init, name, _untouched)
        with torch.device("meta"):
            yield
    finally:
        for name, initialiser in saved.items():
            setattr(nn.init, name, initialiser)


def _untouched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


class CheckpointError(ValueError):
    """A checkpoint directory that we cannot load, with the reason in the message."""


def cache_dir() -> Path:
    """What the engine keeps between starts (fetched model files, the cost model's curves,
    dequantized weights): $TANDEM_CACHE, else ~/.cache/tandem."""
    root = os.environ.get("TANDEM_CACHE") or Path.home() / ".cache" / "tandem"
    return Path(root)
