"""Precomputed target outputs for head training, stored as safetensors shards.

The frozen target runs through the inference model code (`LlamaModel` with the causal
attention backend, in inference mode) over fixed windows of the tokenised corpus. A shard
holds, for its windows of `window` tokens t_0 .. t_{S-1}:

    tokens       [n, S]    int32   the window's token ids
    hidden       [n, S, H] float16 f_i, the target's hidden state after its final norm
    topk_logits  [n, S, K] float16 the target's K largest logits at i (the law of t_{i+1})
    topk_ids     [n, S, K] int16   their token ids (int32 for vocabularies past 32767)
    aux          [n, S, nH] float16 with `aux_layers`: the outputs of those target layers side
                           by side (what an EAGLE-3 head fuses)

Shard j holds windows j, j + G, j + 2G, ... of the G shards, so any set of finished shards
covers the whole corpus evenly. A shard is written to a temporary name and renamed, so an
interrupted run resumes by skipping the shards already there; `meta.json` pins the settings a
resumed run must share.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from models.attention import CausalAttention
from models.llama import LlamaModel

log = logging.getLogger("train")

DATA_DIR = "heads-data"
META = "meta.json"


@dataclass(frozen=True)
class PrecomputeConfig:
    window: int = 512  # tokens per window: the context the heads learn over
    topk: int = 16  # target logits kept per position; the loss renormalises over them
    train_tokens: int = 600_000  # ~0.5 GB for the demo target (0.84 KB a token)
    heldout_tokens: int = 16_384
    shard_windows: int = 32  # windows per shard: the unit of resumption
    batch: int = 4  # windows per target forward
    aux_layers: tuple[int, ...] = ()  # target layers whose outputs are stored too (EAGLE-3's)

    def __post_init__(self) -> None:
        if min(self.window, self.topk, self.shard_windows, self.batch) < 1:
            raise ValueError("window, topk, shard_windows and batch must be positive")
        if self.train_tokens < self.window or self.heldout_tokens < self.window:
            raise ValueError("each split needs at least one window")

    def windows(self, split: str) -> int:
        tokens = self.train_tokens if split == "train" else self.heldout_tokens
        return tokens // self.window


def window_starts(num_tokens: int, count: int, window: int) -> np.ndarray:
    """[n] start offsets of up to `count` evenly spaced, non-overlapping windows."""
    n = min(count, num_tokens // window)
    if n < 1:
        raise ValueError(f"{num_tokens} tokens hold no window of {window}")
    stride = (num_tokens - window) // max(n - 1, 1)
    return np.arange(n, dtype=np.int64) * stride


@torch.inference_mode()
def target_outputs(
    model: LlamaModel,
    ids: torch.Tensor,  # [b, S] int64
    topk: int,
    aux_layers: tuple[int, ...] = (),
) -> dict[str, torch.Tensor]:
    """hidden [b, S, H], top-k logits [b, S, K] and their ids [b, S, K] of the target, and
    with `aux_layers` those layers' outputs side by side [b, S, nH]."""
    b, s = ids.shape
    positions = torch.arange(s, device=ids.device).repeat(b)
    hidden, aux = model(ids.reshape(-1), positions, CausalAttention(b, s), aux_layers)
    values, index = model.logits(hidden).topk(topk, dim=-1)  # [b * S, K]
    out = {"hidden": hidden, "topk_logits": values, "topk_ids": index}
    if aux:
        out["aux"] = torch.cat(aux, dim=-1)
    return {name: t.view(b, s, -1) for name, t in out.items()}


def make_shard(
    model: LlamaModel, tokens: np.ndarray, starts: np.ndarray, cfg: PrecomputeConfig
) -> dict[str, torch.Tensor]:
    """The shard tensors (see the module docstring) for windows at `starts`."""
    rows = [np.asarray(tokens[s : s + cfg.window], dtype=np.int64) for s in starts]
    ids = torch.from_numpy(np.stack(rows))  # [n, S]
    id_dtype = torch.int16 if model.config.vocab_size <= 2**15 else torch.int32
    parts: dict[str, list[torch.Tensor]] = {}
    for chunk in ids.split(cfg.batch):
        out = target_outputs(model, chunk, cfg.topk, cfg.aux_layers)
        for name, t in out.items():
            t = t.to(id_dtype) if name == "topk_ids" else t.half()
            if t.is_floating_point() and not torch.isfinite(t).all():
                raise ValueError(f"target {name} overflow float16")
            parts.setdefault(name, []).append(t)
    shard = {name: torch.cat(chunks).contiguous() for name, chunks in parts.items()}
    return shard | {"tokens": ids.int()}


def shard_path(data_dir: Path, split: str, index: int) -> Path:
    return data_dir / split / f"shard-{index:05d}.safetensors"


def read_meta(data_dir: Path) -> dict:
    return json.loads((data_dir / META).read_text())


def check_meta(data_dir: Path, meta: dict) -> None:
    """Write meta.json, or refuse to resume a store made with other settings."""
    path = data_dir / META
    if path.exists():
        old = json.loads(path.read_text())
        if old != meta:
            raise ValueError(
                f"{data_dir} was precomputed with other settings ({old}); "
                "remove it or pass the same ones"
            )
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(meta, indent=2) + "\n")


def precompute(
    model: LlamaModel, splits: dict[str, np.ndarray], data_dir: Path, cfg: PrecomputeConfig
) -> None:
    """Write the shards of each split (token arrays by split name), skipping finished ones."""
    meta = json.loads(json.dumps(asdict(cfg) | {"hidden_size": model.config.hidden_size}))
    check_meta(data_dir, meta)
    for split, tokens in splits.items():
        starts = window_starts(len(tokens), cfg.windows(split), cfg.window)
        num_shards = -(-len(starts) // cfg.shard_windows)
        groups = [starts[j::num_shards] for j in range(num_shards)]
        (data_dir / split).mkdir(parents=True, exist_ok=True)
        done = sum(shard_path(data_dir, split, i).exists() for i in range(len(groups)))
        log.info(
            "%s: %d windows in %d shards, %d already done", split, len(starts), len(groups), done
        )
        for i, group in enumerate(tqdm(groups, desc=split, unit="shard", mininterval=10)):
            path = shard_path(data_dir, split, i)
            if path.exists():
                continue
            tmp = path.with_suffix(".tmp")
            save_file(make_shard(model, tokens, group, cfg), str(tmp))
            tmp.rename(path)


def load_split(data_dir: Path, split: str) -> list[dict[str, torch.Tensor]]:
    """The shards of a split, each mapped from its file: a shard's pages are read when a batch
    touches them, so a store larger than the memory trains (the page cache holds what fits)."""
    paths = sorted((data_dir / split).glob("shard-*.safetensors"))
    if not paths:
        raise FileNotFoundError(f"no shards in {data_dir / split}: run `precompute` first")
    return [load_file(str(p)) for p in paths]
