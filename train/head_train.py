"""EAGLE and MTP heads trained on precomputed target outputs; the target's embedding and
lm_head are shared and frozen.

Both heads read pairs (t_{i+1}, f_i): the next token and the target's final-normed hidden
state at i, and predict the law of t_{i+2}, which is the target's distribution at i+1. So a
window of S tokens gives S-1 pairs, the same ones for both kinds; only the rotary position
differs (EAGLE puts the pair at i, as its drafter does; MTP at i+1, the token's own).

- EAGLE: smooth-L1 between the head's feature and f_{i+1}, plus 0.1 x the cross-entropy
  against the target's next-token distribution (EAGLE's weights), with uniform noise on the
  input features (EAGLE's regulariser against its own fed-back features at draft time).
- MTP: the cross-entropy, plus `feature_weight` x smooth-L1 between the block output (what the
  head feeds back for its next chained token) and f_{i+1}.

The target's distribution is its top-K logits renormalised (what the store keeps).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models.attention import CausalAttention
from models.eagle import EagleHead
from models.llama import LlamaModel
from models.mtp import MTPHead

log = logging.getLogger("train")

KINDS = ("eagle", "eagle-original", "mtp")
Head = EagleHead | MTPHead


@dataclass(frozen=True)
class HeadLoss:
    kind: str
    feature_weight: float  # smooth-L1 on the next feature
    ce_weight: float  # cross-entropy against the target's distribution
    noise: float  # width of the uniform noise on input features (EAGLE: U(-0.1, 0.1))

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown head kind {self.kind!r}; choose from {KINDS}")
        if min(self.feature_weight, self.ce_weight, self.noise) < 0:
            raise ValueError("loss weights and noise must not be negative")

    @classmethod
    def default(cls, kind: str) -> HeadLoss:
        """EAGLE's weights for the EAGLE heads; the MTP head keeps a small feature term so its
        fed-back block output stays near the target's features (multi-token drafting)."""
        if kind == "mtp":
            return cls(kind, feature_weight=0.1, ce_weight=1.0, noise=0.0)
        return cls(kind, feature_weight=1.0, ce_weight=0.1, noise=0.2)


def build_head(kind: str, target: LlamaModel) -> Head:
    """A freshly initialised head with the target's layer shape (one layer)."""
    cfg = dataclasses.replace(target.config, num_layers=1)
    if kind == "mtp":
        return MTPHead(cfg, target)
    if kind == "eagle":
        return EagleHead(cfg, target, norms=True, fc_bias=False)
    if kind == "eagle-original":  # SafeAILab's EAGLE-1: no norms, fc with a bias
        return EagleHead(cfg, target, norms=False, fc_bias=True)
    raise ValueError(f"unknown head kind {kind!r}; choose from {KINDS}")


def head_kind(head: Head) -> str:
    if isinstance(head, MTPHead):
        return "mtp"
    return "eagle" if head.norms else "eagle-original"


class HeadData:
    """One precomputed split in memory (tensors as `train.head_data` stores them)."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.tokens = tensors["tokens"]  # [N, S] int32
        self.hidden = tensors["hidden"]  # [N, S, H] float16
        self.topk_logits = tensors["topk_logits"]  # [N, S, K] float16
        self.topk_ids = tensors["topk_ids"]  # [N, S, K] int16 / int32

    def __len__(self) -> int:
        return self.tokens.shape[0]

    @property
    def window(self) -> int:
        return self.tokens.shape[1]

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The windows `index` [b] with float32 features and int64 ids."""
        return {
            "tokens": self.tokens[index].long(),
            "hidden": self.hidden[index].float(),
            "topk_logits": self.topk_logits[index].float(),
            "topk_ids": self.topk_ids[index].long(),
        }


class IndexSampler:
    """Random window indices [batch] from a seeded generator (its state travels in
    checkpoints, as `train.data.WindowSampler`'s does)."""

    def __init__(self, num_windows: int, batch: int, seed: int):
        self.num_windows, self.size = num_windows, batch
        self.rng = np.random.default_rng(seed)

    def next(self) -> torch.Tensor:
        return torch.from_numpy(self.rng.integers(0, self.num_windows, size=self.size))

    def state(self) -> dict:
        return dict(self.rng.bit_generator.state)

    def load_state(self, state: dict) -> None:
        self.rng.bit_generator.state = state


def soft_cross_entropy(
    logits: torch.Tensor,  # [R, V] the head's
    topk_logits: torch.Tensor,  # [R, K] the target's largest logits
    topk_ids: torch.Tensor,  # [R, K]
) -> torch.Tensor:
    """Mean of -sum_j p_j log q_j, with p the target's top-K renormalised."""
    p = torch.softmax(topk_logits, dim=-1)
    log_q = torch.log_softmax(logits.float(), dim=-1).gather(1, topk_ids)  # [R, K]
    return -(p * log_q).sum(-1).mean()


def head_forward(
    head: Head, batch: dict[str, torch.Tensor], noise: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's features and logits [b * (S-1), H | V] over the pairs (t_{i+1}, f_i)."""
    tokens, hidden = batch["tokens"], batch["hidden"]
    b, s = tokens.shape
    features = hidden[:, :-1]  # [b, S-1, H] f_i
    if noise:
        features = features + (torch.rand_like(features) - 0.5) * noise
    offset = 1 if isinstance(head, MTPHead) else 0
    positions = torch.arange(s - 1).repeat(b) + offset  # [b * (S-1)]
    attn = CausalAttention(b, s - 1)
    out = head(tokens[:, 1:].reshape(-1), features.reshape(b * (s - 1), -1), positions, attn)
    return out, head.logits(out)


def loss_terms(
    head: Head, batch: dict[str, torch.Tensor], loss: HeadLoss, noise: float
) -> dict[str, torch.Tensor]:
    """Scalar terms: "feature" (smooth-L1), "ce", their weighted "loss", and "top1" (the
    head's argmax equals the target's, no gradient)."""
    out, logits = head_forward(head, batch, noise)
    h = out.shape[-1]
    next_features = batch["hidden"][:, 1:].reshape(-1, h)  # [R, H] f_{i+1}
    k = batch["topk_ids"].shape[-1]
    topk_logits = batch["topk_logits"][:, 1:].reshape(-1, k)  # [R, K] law of t_{i+2}
    topk_ids = batch["topk_ids"][:, 1:].reshape(-1, k)
    feature = F.smooth_l1_loss(out, next_features)
    ce = soft_cross_entropy(logits, topk_logits, topk_ids)
    top1 = (logits.argmax(-1) == topk_ids[:, 0]).float().mean().detach()
    total = loss.feature_weight * feature + loss.ce_weight * ce
    return {"loss": total, "feature": feature, "ce": ce, "top1": top1}


def training_loss(head: Head, data: HeadData, loss: HeadLoss, index: torch.Tensor) -> torch.Tensor:
    """The loss of windows `index` [b], with the feature noise (train.loop's LossFn)."""
    return loss_terms(head, data.batch(index), loss, loss.noise)["loss"]


@torch.no_grad()
def heldout_metrics(head: Head, data: HeadData, loss: HeadLoss, batch: int = 8) -> dict:
    """Mean loss terms over all held-out windows, without noise (teacher-forced, depth 1)."""
    was_training = head.training
    head.eval()
    sums: dict[str, float] = {}
    for index in torch.arange(len(data)).split(batch):
        for name, value in loss_terms(head, data.batch(index), loss, 0.0).items():
            sums[name] = sums.get(name, 0.0) + value.item() * len(index)
    head.train(was_training)
    return {name: total / len(data) for name, total in sums.items()}


def freeze_shared(target: LlamaModel) -> None:
    """The target (embedding and lm_head included) takes no gradient and no optimiser state."""
    target.eval().requires_grad_(False)


def trainable(head: nn.Module) -> int:
    return sum(p.numel() for p in head.parameters() if p.requires_grad)
