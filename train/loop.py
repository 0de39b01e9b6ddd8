"""The training loop shared by the target and the draft: a wall-clock budget, resumable.

The learning-rate schedule is defined over the time budget, because on a CPU the budget is
what is fixed: linear warm-up over the first steps, then a cosine from the peak down to
`final_lr_ratio` of it as the elapsed training time reaches the budget. A run bounded by a
step count (`max_steps`: so many epochs) runs its cosine over the steps instead. Elapsed time
and steps are saved in checkpoints, so a resumed run continues the same schedule.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from tqdm import tqdm

from train.data import WindowSampler

log = logging.getLogger("train")

CHECKPOINT = "checkpoint.pt"
BEST = "best.pt"  # the weights of the checkpoint with the lowest validation loss


@dataclass(frozen=True)
class TrainConfig:
    minutes: float  # wall-clock training budget; the schedule ends when it is spent
    lr: float = 1e-3
    warmup_steps: int = 50
    final_lr_ratio: float = 0.1
    batch: int = 8
    seq: int = 512
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    checkpoint_minutes: float = 5.0  # a lost run costs at most this much
    log_every: int = 10
    seed: int = 0
    max_steps: int = 0  # 0: no limit besides the budget (tests set a few steps)
    # the forward under bfloat16 autocast (float32 weights, optimiser and loss reductions):
    # what pays on a CPU with bfloat16 dot products (cpu_has_bf16; docs/models.md)
    bf16: bool = False

    def __post_init__(self) -> None:
        if self.minutes <= 0 or self.batch <= 0 or self.seq <= 0:
            raise ValueError("minutes, batch and seq must be positive")

    def lr_at(self, step: int, elapsed_s: float) -> float:
        """Linear warm-up, then a cosine over the run: its steps where `max_steps` bounds it
        (a run of so many epochs; paused time does not count), else its time budget."""
        warm = min(1.0, (step + 1) / self.warmup_steps)
        if self.max_steps:
            progress = min(1.0, step / self.max_steps)
        else:
            progress = min(1.0, elapsed_s / (self.minutes * 60))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))
        return self.lr * warm * (self.final_lr_ratio + (1 - self.final_lr_ratio) * cosine)


# The loss of one batch [batch, seq + 1] of token ids; returns a scalar to minimise.
LossFn = Callable[[torch.Tensor], torch.Tensor]


def make_optimizer(model: nn.Module, cfg: TrainConfig) -> torch.optim.AdamW:
    """AdamW; matrices (and embeddings) decay, norm gains do not."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    keep = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas)


@dataclass
class TrainState:
    step: int = 0
    elapsed_s: float = 0.0
    tokens: int = 0
    best_loss: float = math.inf  # the lowest validation loss at a checkpoint
    best_step: int = 0


def save_checkpoint(
    run_dir: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    state: TrainState,
    sampler: WindowSampler,
) -> None:
    """Written to a temporary file and renamed, so a crash never leaves half a checkpoint."""
    payload = {
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "state": vars(state),
        "torch_rng": torch.get_rng_state(),
        "sampler": sampler.state(),
    }
    tmp = run_dir / (CHECKPOINT + ".tmp")
    torch.save(payload, tmp)
    tmp.rename(run_dir / CHECKPOINT)


def load_checkpoint(
    run_dir: Path, model: nn.Module, opt: torch.optim.Optimizer, sampler: WindowSampler
) -> TrainState:
    payload = torch.load(run_dir / CHECKPOINT, weights_only=False)
    model.load_state_dict(payload["model"])
    opt.load_state_dict(payload["optimizer"])
    torch.set_rng_state(payload["torch_rng"])
    sampler.load_state(payload["sampler"])
    return TrainState(**payload["state"])


def train(
    model: nn.Module,
    loss_fn: LossFn,
    sampler: WindowSampler,
    cfg: TrainConfig,
    run_dir: Path,
    resume: bool = False,
    evaluate: Callable[[], float] | None = None,
) -> TrainState:
    """Train until the time budget (or `max_steps`) is spent; checkpoints into `run_dir`.

    `evaluate` (a validation loss) runs at every checkpoint; the weights of the checkpoint
    where it is lowest are kept in `run_dir/BEST` (load_best).
    """
    opt = make_optimizer(model, cfg)
    state = TrainState()
    if resume and (run_dir / CHECKPOINT).exists():
        state = load_checkpoint(run_dir, model, opt, sampler)
        log.info("resumed at step %d, %.1f min elapsed", state.step, state.elapsed_s / 60)
    budget_s = cfg.minutes * 60
    last_save = state.elapsed_s
    bar = tqdm(total=round(budget_s), initial=round(state.elapsed_s), unit="s", mininterval=10)
    model.train()
    while state.elapsed_s < budget_s and not (cfg.max_steps and state.step >= cfg.max_steps):
        started = time.perf_counter()
        lr = cfg.lr_at(state.step, state.elapsed_s)
        loss, grad_norm = optimizer_step(model, loss_fn, opt, sampler.next(), lr, cfg)
        took = time.perf_counter() - started
        state.step += 1
        state.elapsed_s += took
        state.tokens += cfg.batch * cfg.seq
        bar.update(round(state.elapsed_s) - bar.n)
        if state.step % cfg.log_every == 0 or state.step == 1:
            log.info(
                "step %d loss %.4f lr %.2e grad %.2f | %.0f tok/s | %.2fM tokens | %.1f min",
                *(state.step, loss, lr, grad_norm, cfg.batch * cfg.seq / took),
                *(state.tokens / 1e6, state.elapsed_s / 60),
            )
        if state.elapsed_s - last_save >= cfg.checkpoint_minutes * 60:
            _checkpoint(run_dir, model, opt, state, sampler, evaluate)
            last_save = state.elapsed_s
    bar.close()
    _checkpoint(run_dir, model, opt, state, sampler, evaluate)
    return state


def optimizer_step(
    model: nn.Module,
    loss_fn: LossFn,
    opt: torch.optim.Optimizer,
    batch: torch.Tensor,  # [batch, seq + 1]
    lr: float,
    cfg: TrainConfig,
) -> tuple[float, float]:
    """One optimiser step; returns the loss and the gradient norm before clipping."""
    for group in opt.param_groups:
        group["lr"] = lr
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16):
        loss = loss_fn(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
    opt.step()
    return loss.item(), grad_norm.item()


def cpu_has_bf16() -> bool:
    """Whether this CPU computes bfloat16 dot products natively (AVX512-BF16 or AMX): read at
    run time, since the machines this runs on differ."""
    try:
        flags = Path("/proc/cpuinfo").read_text().split()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _checkpoint(
    run_dir: Path,
    model: nn.Module,
    opt: torch.optim.Optimizer,
    state: TrainState,
    sampler: WindowSampler,
    evaluate: Callable[[], float] | None,
) -> None:
    if evaluate is not None:
        loss = evaluate()
        if loss < state.best_loss:
            state.best_loss, state.best_step = loss, state.step
            torch.save(model.state_dict(), run_dir / BEST)
        log.info("checkpoint at step %d, validation loss %.4f", state.step, loss)
    save_checkpoint(run_dir, model, opt, state, sampler)
    model.train()


def load_best(run_dir: Path, model: nn.Module, state: TrainState) -> None:
    """The weights of the checkpoint with the lowest validation loss, where one was kept."""
    if (run_dir / BEST).exists():
        model.load_state_dict(torch.load(run_dir / BEST))
        log.info(
            "the best checkpoint: step %d, validation loss %.4f", state.best_step, state.best_loss
        )
