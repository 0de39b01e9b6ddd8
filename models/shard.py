"""Tensor parallelism inside the models (Megatron style): which slice of every weight a rank
holds, and the collectives that put the slices' products back together.

The rule, per weight (`Shard.take`):
- q|k|v and gate|up are split over their outputs (column-parallel): each rank holds
  num_heads / N query heads, its key-value heads (num_kv_heads / N of them, or, where N is a
  multiple of num_kv_heads, the one head its query heads read, replicated), and
  intermediate_size / N of the MLP;
- o and down are split over their inputs (row-parallel) and followed by one all-reduce each;
  so are a head's input projections (EAGLE's `fc`, MTP's `eh_proj`), whose rank takes its
  columns of the full input;
- the target's embedding and lm_head are split over the vocabulary (ceil(V / N) rows a rank,
  the last rank's padded with zeros): the embedding sums the ranks' rows with an all-reduce,
  the logits are all-gathered. They are the largest matrices of a small model (SmolLM2's are
  113 MB of its 538), so they are never replicated. A head's own lm_head (EAGLE-3's draft
  vocabulary) and every norm are replicated.
A process group of one is never built: without tensor parallelism none of this runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from models.llama import MLP, LlamaConfig, SelfAttention


@dataclass(frozen=True)
class Shard:
    """This process's place in a tensor-parallel group of `size` ranks."""

    rank: int
    size: int

    def check(self, cfg: LlamaConfig, what: str = "the target") -> None:
        """Refuse a model whose heads or MLP do not split over the group, naming the rule."""
        n, heads, kv = self.size, cfg.num_heads, cfg.num_kv_heads
        if heads % n or (kv % n and n % kv):
            raise ValueError(
                f"--tensor-parallel-size {n} does not fit {what}: its {heads} attention heads "
                f"must divide by {n}, and its {kv} key-value heads must divide by {n} or {n} by "
                f"them (sizes that fit: {', '.join(map(str, fitting_sizes(cfg)))})"
            )
        if cfg.intermediate_size % n:
            raise ValueError(
                f"--tensor-parallel-size {n} does not fit {what}: its intermediate size "
                f"{cfg.intermediate_size} must divide by {n}"
            )

    def local_config(self, cfg: LlamaConfig) -> LlamaConfig:
        """The shapes this rank's slice of a model has (head_dim and the vocabulary stay)."""
        self.check(cfg)
        n = self.size
        return dataclasses.replace(
            cfg,
            num_heads=cfg.num_heads // n,
            num_kv_heads=max(1, cfg.num_kv_heads // n),
            intermediate_size=cfg.intermediate_size // n,
        )

    def _range(self, total: int) -> tuple[int, int]:
        step = -(-total // self.size)
        return self.rank * step, self.rank * step + step

    def take(self, name: str, full: Any, cfg: LlamaConfig, vocab: bool) -> torch.Tensor:
        """This rank's slice of weight `name` (a tensor, or a safetensors slice read only
        where taken) of a model with config `cfg`. `vocab`: the model's embedding and lm_head
        are split over the vocabulary (the target's)."""
        n, d = self.size, cfg.head_dim
        shape = tuple(full.shape) if isinstance(full, torch.Tensor) else tuple(full.get_shape())
        module, _, kind = name.rpartition(".")
        role = module.rpartition(".")[2]
        if role == "q_proj":
            a, b = self._range(cfg.num_heads)
            return full[a * d : b * d]
        if role in ("k_proj", "v_proj"):
            kv = cfg.num_kv_heads
            first = self.rank * kv // n if kv < n else self.rank * (kv // n)
            count = max(1, kv // n)
            return full[first * d : (first + count) * d]
        if role == "o_proj":
            a, b = self._range(cfg.num_heads)
            return full[:, a * d : b * d]
        if role in ("gate_proj", "up_proj"):
            a, b = self._range(cfg.intermediate_size)
            return full[a:b]
        if role == "down_proj":
            a, b = self._range(cfg.intermediate_size)
            return full[:, a:b]
        if role in ("fc", "eh_proj") and kind == "weight":
            if shape[1] % n:
                raise ValueError(f"{name}'s {shape[1]} inputs do not divide by {n} ranks")
            a, b = self._range(shape[1])
            return full[:, a:b]
        if vocab and name in ("embed_tokens.weight", "lm_head.weight"):
            a, b = self._range(shape[0])
            rows = full[a : min(b, shape[0])]
            return F.pad(rows, (0, 0, 0, b - a - rows.shape[0]))  # the last rank's padding
        return full if isinstance(full, torch.Tensor) else full[:]


def fitting_sizes(cfg: LlamaConfig) -> list[int]:
    """The group sizes a model's heads allow (up to its head count)."""
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    return [
        n
        for n in range(1, heads + 1)
        if not heads % n and not (kv % n and n % kv) and not cfg.intermediate_size % n
    ]


@dataclass
class Traffic:
    """Bytes this process has sent through each collective (measured, for bench/ and the
    metrics)."""

    broadcast: int = 0
    all_reduce: int = 0
    all_gather: int = 0


traffic = Traffic()


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x)
    traffic.all_reduce += x.numel() * x.element_size()
    return x


class RowParallel(nn.Module):
    """A linear split over its inputs: this rank's columns, the ranks' products summed.
    `splits_input`: it gets the whole input and takes its own columns (a head's projection);
    else the input is already this rank's (o, down). The bias, if any, is added once."""

    linear: Any
    bias: torch.Tensor | None

    def __init__(self, linear: Any, shard: Shard, splits_input: bool):
        super().__init__()
        self.linear = linear
        self.bias = linear.bias
        linear.bias = None
        self.shard, self.splits_input = shard, splits_input

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.splits_input:
            x = x.chunk(self.shard.size, -1)[self.shard.rank]
        y = all_reduce(self.linear(x))
        return y if self.bias is None else y + self.bias


class VocabEmbedding(nn.Module):
    """An embedding split over the vocabulary: a rank looks up the ids in its rows, zeros
    elsewhere, and the ranks' rows are summed."""

    def __init__(self, embedding: nn.Embedding, shard: Shard):
        super().__init__()
        self.weight = embedding.weight  # [ceil(V / N), H] this rank's rows
        self.start = shard.rank * self.weight.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return all_reduce(x * inside[..., None])


class VocabHead(nn.Module):
    """An lm_head split over the vocabulary: each rank's logits, all-gathered in rank order
    and cut back to the vocabulary."""

    linear: Any

    def __init__(self, linear: nn.Module, shard: Shard, vocab_size: int):
        super().__init__()
        self.linear = linear
        self.size, self.vocab_size = shard.size, vocab_size

    @property
    def weight(self) -> torch.Tensor:
        return self.linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = self.linear(x).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local)
        traffic.all_gather += local.numel() * local.element_size()
        return torch.cat(parts, -1)[..., : self.vocab_size]


def shard_module(
    module: Any,
    shard: Shard,
    vocab: bool,
    source: Callable[[str], Any] | None = None,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> None:
    """Make `module` (a target, or a head; its `config` a LlamaConfig) this rank's slice, in
    place: its parameters replaced by their slices (`Shard.take`) of `source(name)` (a
    checkpoint's tensor or lazy slice, put in `dtype` on `device`; None: the parameter's own
    values), the attention's head counts and the config made local, and the collectives put
    around the split products (module docstring). `vocab`: the target's embedding and lm_head
    are split too. Before prepare_for_inference."""
    cfg: LlamaConfig = module.config
    local = shard.local_config(cfg)
    for name, param in list(module.named_parameters()):
        full = param.detach() if source is None else source(name)
        owner_name, _, attr = name.rpartition(".")
        owner = module.get_submodule(owner_name)
        sliced = shard.take(name, full, cfg, vocab)
        sliced = sliced.to(device=device or param.device, dtype=dtype or param.dtype)
        setattr(owner, attr, nn.Parameter(sliced.contiguous(), requires_grad=False))
    for sub in list(module.modules()):
        if isinstance(sub, SelfAttention):
            sub.num_heads, sub.num_kv_heads = local.num_heads, local.num_kv_heads
            sub.o_proj = RowParallel(sub.o_proj, shard, splits_input=False)  # type: ignore[assignment]
        elif isinstance(sub, MLP):
            sub.down_proj = RowParallel(sub.down_proj, shard, splits_input=False)  # type: ignore[assignment]
    for attr in ("fc", "eh_proj"):
        if isinstance(getattr(module, attr, None), nn.Linear):
            setattr(module, attr, RowParallel(getattr(module, attr), shard, splits_input=True))
    if vocab:
        embed: Any = module.embed_tokens
        if cfg.tie_word_embeddings:
            module.lm_head.weight = embed.weight
        module.embed_tokens = VocabEmbedding(embed, shard)
        module.lm_head = VocabHead(module.lm_head, shard, cfg.vocab_size)
    module.config = local
