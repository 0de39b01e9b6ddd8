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

- EAGLE-3: training-time test. The head runs `ttt_steps` times over each window: step 0 over
  the fused target layers (f_i = fc(aux_i)), each later step over its own previous outputs,
  one token further on, its queries seeing step 0's keys causally and the keys the later steps
  wrote at their own column (as a drafted chain sees the committed pairs and its own drafts).
  Each step's loss is the cross-entropy against the target's distribution at that position
  restricted to the draft vocabulary; no feature term.

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
from models.eagle import Eagle3Head, EagleHead
from models.llama import LlamaModel
from models.mtp import MTPHead

log = logging.getLogger("train")

KINDS = ("eagle", "eagle-original", "eagle3", "mtp")
Head = EagleHead | Eagle3Head | MTPHead
TTT_STEPS = 4  # EAGLE-3's unrolled steps: the draft length it learns to serve
TTT_DECAY = 0.8  # weight of step j's loss: decay ** j (deeper drafts matter less)


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
        if kind == "eagle3":
            return cls(kind, feature_weight=0.0, ce_weight=1.0, noise=0.0)
        return cls(kind, feature_weight=1.0, ce_weight=0.1, noise=0.2)


def draft_vocabulary(tokens: np.ndarray, size: int) -> torch.Tensor:
    """[size] the most frequent target ids of the training tokens (EAGLE-3's draft vocabulary;
    ties by id)."""
    counts = np.bincount(np.asarray(tokens, dtype=np.int64).ravel(), minlength=size)
    order = np.lexsort((np.arange(len(counts)), -counts))  # by count, then id
    return torch.from_numpy(np.sort(order[:size]))


def build_head(
    kind: str,
    target: LlamaModel,
    draft_ids: torch.Tensor | None = None,
    target_layers: tuple[int, ...] = (),
) -> Head:
    """A freshly initialised head with the target's layer shape (one layer). An EAGLE-3 head
    reads the outputs of `target_layers` (the store's), its draft vocabulary is `draft_ids`,
    and its lm_head and norm start as the target's."""
    cfg = dataclasses.replace(target.config, num_layers=1)
    if kind == "eagle3":
        assert draft_ids is not None and target_layers
        aux = tuple(i + 1 for i in target_layers)  # the residual entering the next layer
        head = Eagle3Head(cfg, target, aux, len(draft_ids))
        head.set_draft_vocab(draft_ids)
        assert head.lm_head is not None
        with torch.no_grad():
            head.lm_head.weight.copy_(target.lm_head.weight[head.draft_ids])
            head.norm.weight.copy_(target.norm.weight)
        return head
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
    if isinstance(head, Eagle3Head):
        return "eagle3"
    return "eagle" if head.norms else "eagle-original"


class HeadData:
    """Windows of one precomputed split: its shards' tensors (as `train.head_data` stores them,
    mapped from their files) and the (shard, row) of each window this set holds."""

    def __init__(
        self,
        shards: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
        windows: torch.Tensor | None = None,  # [N, 2] (shard, row); None: all of them
    ):
        self.shards = [shards] if isinstance(shards, dict) else shards
        if windows is None:
            windows = torch.cat(
                [
                    torch.stack(
                        (torch.full((len(s["tokens"]),), i), torch.arange(len(s["tokens"]))), 1
                    )
                    for i, s in enumerate(self.shards)
                ]
            )
        self.windows = windows

    def __len__(self) -> int:
        return len(self.windows)

    def has(self, name: str) -> bool:
        return name in self.shards[0]

    def without(self, name: str) -> HeadData:
        """The same windows without one stored tensor (EAGLE-3 reads no final hidden state)."""
        shards = [{k: t for k, t in s.items() if k != name} for s in self.shards]
        return HeadData(shards, self.windows)

    def gather(self, name: str, index: torch.Tensor | None = None) -> torch.Tensor:
        """[b, S, ...] tensor `name` of windows `index` (all of them by default), as stored."""
        picks = (self.windows if index is None else self.windows[index]).tolist()
        first = self.shards[0][name]
        out = first.new_empty((len(picks), *first.shape[1:]))
        for i, (s, r) in enumerate(picks):  # row copies: no autocast op (it rejects float16)
            out[i] = self.shards[s][name][r]
        return out

    @property
    def tokens(self) -> torch.Tensor:
        return self.gather("tokens")  # [N, S] int32

    def subset(self, fraction: float, seed: int) -> HeadData:
        """A seeded random share of the windows (a learning curve's smaller data sets, each
        inside the larger ones: the same order, cut shorter)."""
        if not 0 < fraction <= 1:
            raise ValueError(f"fraction must be in (0, 1], got {fraction}")
        if fraction == 1:
            return self
        order = torch.randperm(len(self), generator=torch.Generator().manual_seed(seed))
        keep = order[: max(1, round(fraction * len(self)))].sort().values
        return HeadData(self.shards, self.windows[keep])

    @property
    def window(self) -> int:
        return self.shards[0]["tokens"].shape[1]

    def batch(self, index: torch.Tensor) -> dict[str, torch.Tensor]:
        """The windows `index` [b] with float32 features and int64 ids: tokens [b, S], the
        target's top-k logits and ids [b, S, K], and where stored hidden [b, S, H] and
        aux [b, S, nH]."""
        batch = {}
        for name in self.shards[0]:
            t = self.gather(name, index)
            batch[name] = t.float() if t.is_floating_point() else t.long()
        return batch


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
    positions = torch.arange(s - 1).repeat(b) + head.pair_offset  # [b * (S-1)]
    attn = CausalAttention(b, s - 1)
    out = head(tokens[:, 1:].reshape(-1), features.reshape(b * (s - 1), -1), positions, attn)
    return out, head.logits(out)


class UnrolledAttention:
    """Training-time test's attention for a one-layer head over [batch, seq] columns: the
    first call (step 0) is causal; step j's query at column i sees step 0's keys 0 .. i and the
    keys steps 1 .. j wrote at column i."""

    def __init__(self, batch: int, seq: int):
        self.batch, self.seq = batch, seq
        self.keys: list[torch.Tensor] = []  # per step [b, Hq, S, D]
        self.values: list[torch.Tensor] = []

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b, s = self.batch, self.seq
        hq, hkv, d = q.shape[1], k.shape[1], q.shape[2]
        qb = q.view(b, s, hq, d).transpose(1, 2)
        self.keys.append(k.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1))
        self.values.append(v.view(b, s, hkv, d).transpose(1, 2).repeat_interleave(hq // hkv, 1))
        if len(self.keys) == 1:
            out = F.scaled_dot_product_attention(qb, self.keys[0], self.values[0], is_causal=True)
            return out.transpose(1, 2).reshape(b * s, hq, d)
        scale = d**-0.5
        causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        first = (qb @ self.keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
        own = torch.stack([(qb * key).sum(-1) for key in self.keys[1:]], -1) * scale  # [b,h,S,j]
        p = torch.softmax(torch.cat((first, own), -1), -1)
        later = torch.stack(self.values[1:], -2)  # [b, h, S, j, D]
        out = p[..., :s] @ self.values[0] + (p[..., s:, None] * later).sum(-2)
        return out.transpose(1, 2).reshape(b * s, hq, d)


def restricted_cross_entropy(
    logits: torch.Tensor,  # [R, Vd] the head's, over the draft vocabulary
    topk_logits: torch.Tensor,  # [R, K] the target's largest logits
    draft_index: torch.Tensor,  # [R, K] their draft ids, -1 outside the draft vocabulary
    valid: torch.Tensor,  # [R] bool rows that count
) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean of -sum_j p_j log q_j over valid rows, with p the target's top-K restricted to the
    draft vocabulary and renormalised (rows with none of it inside do not count); and the
    share of rows whose argmax is the target's top-1 (no gradient)."""
    inside = draft_index >= 0
    valid = valid & inside.any(-1)
    p = torch.softmax(topk_logits.masked_fill(~inside, float("-inf")), -1).nan_to_num(0.0)
    log_q = torch.log_softmax(logits.float(), -1).gather(1, draft_index.clamp(min=0))
    ce = -(p * log_q).sum(-1)
    top1 = (logits.argmax(-1) == draft_index[:, 0]) & valid
    count = valid.sum().clamp(min=1)
    return (ce * valid).sum() / count, (top1.sum() / count).detach()


def eagle3_terms(
    head: Eagle3Head, batch: dict[str, torch.Tensor], steps: int = TTT_STEPS
) -> dict[str, torch.Tensor]:
    """EAGLE-3's training-time test over the windows (module docstring): "loss" (the steps'
    cross-entropies weighted by TTT_DECAY ** j), and per step "ce{j}" and "top1_{j}"."""
    tokens, aux = batch["tokens"], batch["aux"]
    b, s = tokens.shape
    n = s - 1  # columns: pair i = (t_{i+1}, f_i)
    index = torch.full((head.t2d.numel(),), -1, dtype=torch.long, device=tokens.device)
    index[head.draft_ids] = torch.arange(head.draft_ids.numel(), device=tokens.device)
    features = head.fuse(aux[:, :-1])  # [b, n, H]
    attn = UnrolledAttention(b, n)
    columns = torch.arange(n, device=tokens.device)
    terms: dict[str, torch.Tensor] = {"loss": features.new_zeros(())}
    for j in range(steps):
        # step j at column i: pair (t_{i+1+j}, its feature) at position i + j, predicting the
        # target's law at i + 1 + j; columns past the window's end run on padding, unscored
        shift = torch.clamp(columns + 1 + j, max=s - 1)  # [n]
        ids = tokens[:, shift]  # [b, n]
        positions = (columns + j).repeat(b)
        out = head(ids.flatten(), features.reshape(b * n, -1), positions, attn)
        logits = head.draft_logits(out)  # [b * n, Vd]
        k = batch["topk_ids"].shape[-1]
        law = batch["topk_logits"][:, shift].reshape(-1, k)
        draft_index = index[batch["topk_ids"][:, shift].reshape(-1, k)]
        valid = (columns + 1 + j <= s - 1).repeat(b)
        ce, top1 = restricted_cross_entropy(logits, law, draft_index, valid)
        terms["loss"] = terms["loss"] + TTT_DECAY**j * ce
        terms[f"ce{j}"], terms[f"top1_{j}"] = ce, top1
        features = out.view(b, n, -1)
    return terms


def loss_terms(
    head: Head, batch: dict[str, torch.Tensor], loss: HeadLoss, noise: float
) -> dict[str, torch.Tensor]:
    """Scalar terms: "feature" (smooth-L1), "ce", their weighted "loss", and "top1" (the
    head's argmax equals the target's, no gradient); EAGLE-3's are `eagle3_terms`."""
    if isinstance(head, Eagle3Head):
        return eagle3_terms(head, batch)
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
