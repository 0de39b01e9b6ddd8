"""Head training throughput against the machine's floor: `python -m bench.train_step`.

    python -m bench.train_step [--target smollm2] [--kind eagle3] [--batches 4 8 16]
        [--window 512] [--steps 5] [--out bench/results/train_step.json]

One optimiser step of a head (forward, backward, AdamW) on windows of stored-data shapes
(random features: the time does not depend on their values), float32 and under bfloat16
autocast where the CPU has bfloat16 dot products. Per cell: token-steps/s (training tokens a
second: a window of S tokens is S - 1 pairs), the step's FLOPs counted by torch's FlopCounter
(forward and backward), the GFLOP/s reached, and that as a share of the floor: the same
FLOPs at the rate of one large matrix product of the same dtype on this machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.utils.flop_counter import FlopCounterMode

from models.eagle import default_aux_layers
from train import head_train
from train.head_train import HeadData, HeadLoss
from train.heads import load_target
from train.loop import TrainConfig, cpu_has_bf16, make_optimizer, optimizer_step

TOPK = 16
PEAK_SIZE = 2048  # a square product large enough to reach the machine's matmul rate


def peak_gflops(dtype: torch.dtype, repeats: int = 10) -> float:
    a = torch.randn(PEAK_SIZE, PEAK_SIZE).to(dtype)
    b = torch.randn(PEAK_SIZE, PEAK_SIZE).to(dtype)
    a @ b
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        times.append(time.perf_counter() - start)
    return 2 * PEAK_SIZE**3 / min(times) / 1e9


def synthetic_data(target, kind: str, windows: int, window: int) -> HeadData:
    cfg = target.config
    g = torch.Generator().manual_seed(0)
    tensors = {
        "tokens": torch.randint(0, cfg.vocab_size, (windows, window), generator=g).int(),
        "hidden": torch.randn(windows, window, cfg.hidden_size, generator=g).half(),
        "topk_logits": torch.randn(windows, window, TOPK, generator=g).half(),
        "topk_ids": torch.randint(0, cfg.vocab_size, (windows, window, TOPK), generator=g).int(),
    }
    if kind == "eagle3":
        aux = torch.randn(windows, window, 3 * cfg.hidden_size, generator=g)
        tensors["aux"] = aux.half()
    return HeadData(tensors)


def measure(target, kind: str, batch: int, window: int, bf16: bool, steps: int) -> dict:
    draft_ids = torch.arange(8192) if kind == "eagle3" else None
    layers = tuple(i - 1 for i in default_aux_layers(target.config.num_layers))
    head = head_train.build_head(kind, target, draft_ids, layers if kind == "eagle3" else ())
    data = synthetic_data(target, kind, 2 * batch, window)
    loss = HeadLoss.default(kind)
    cfg = TrainConfig(minutes=60, batch=batch, seq=window - 1, bf16=bf16)
    opt = make_optimizer(head, cfg)
    index = torch.arange(batch)

    def loss_fn(_: torch.Tensor) -> torch.Tensor:
        return head_train.training_loss(head, data, loss, index)

    with FlopCounterMode(display=False) as counter:
        optimizer_step(head, loss_fn, opt, index, 1e-4, cfg)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        optimizer_step(head, loss_fn, opt, index, 1e-4, cfg)
        times.append(time.perf_counter() - start)
    seconds = statistics.median(times)
    flops = counter.get_total_flops()
    return {
        "kind": kind,
        "batch": batch,
        "window": window,
        "bf16": bf16,
        "step_s": round(seconds, 4),
        "token_steps_per_s": round(batch * (window - 1) / seconds, 1),
        "gflop_per_step": round(flops / 1e9, 2),
        "gflops": round(flops / seconds / 1e9, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.train_step", description=__doc__)
    p.add_argument("--target", default="smollm2")
    p.add_argument("--kind", default="eagle3", choices=head_train.KINDS)
    p.add_argument("--batches", type=int, nargs="+", default=[4, 8, 16])
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed steps (median)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    target = load_target(args.target)
    modes = [False, True] if cpu_has_bf16() else [False]
    peaks = {bf16: peak_gflops(torch.bfloat16 if bf16 else torch.float32) for bf16 in modes}
    rows = []
    print("| kind | batch | dtype | step s | token-steps/s | GFLOP a step | GFLOP/s | of peak |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for bf16 in modes:
        for batch in args.batches:
            row = measure(target, args.kind, batch, args.window, bf16, args.steps)
            row["peak_gflops"] = round(peaks[bf16], 1)
            row["of_peak"] = round(row["gflops"] / peaks[bf16], 3)
            rows.append(row)
            dtype = "bf16 autocast" if bf16 else "float32"
            print(
                f"| {args.kind} | {batch} | {dtype} | {row['step_s']} | "
                f"{row['token_steps_per_s']} | {row['gflop_per_step']} | {row['gflops']} | "
                f"{row['of_peak']:.0%} of {row['peak_gflops']} |",
                flush=True,
            )
    if not cpu_has_bf16():
        print("this CPU has no bfloat16 dot products: float32 only")
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "peaks": peaks}, indent=1) + "\n")


if __name__ == "__main__":
    main()
