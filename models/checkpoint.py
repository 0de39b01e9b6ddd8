"""What every checkpoint reader shares: its error, the placeholders weights load into, and
a Hugging Face directory's files (config.json and its safetensors)."""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

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


def first_id(value: int | list[int] | None) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value


def read_config(directory: str | Path) -> dict[str, Any]:
    path = Path(directory) / CONFIG
    if not path.is_file():
        raise CheckpointError(f"no {CONFIG} in {directory}")
    with open(path) as f:
        return json.load(f)


def safetensors_files(directory: str | Path) -> list[Path]:
    """The weight files of a directory: model.safetensors, or the shards its index names."""
    root = Path(directory)
    if (root / WEIGHTS).is_file():
        return [root / WEIGHTS]
    if not (root / INDEX).is_file():
        raise CheckpointError(f"no {WEIGHTS} or {INDEX} in {directory}")
    with open(root / INDEX) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{INDEX} in {directory} has no weight_map")
    files = [root / name for name in sorted(set(weight_map.values()))]
    for path in files:
        if not path.is_file():
            raise CheckpointError(f"shard {path.name} listed in {INDEX} is missing")
    return files


def iter_safetensors(directory: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, CPU tensor) for every tensor of a directory, one at a time (bounded memory)."""
    for path in safetensors_files(directory):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_safetensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory (single file or sharded) by its name in the file."""
    return dict(iter_safetensors(directory))
