"""What a verify pass costs: a target step over M tokens per sequence against a one-token step.

python -m bench.verify_cost [--batches 1] [--context 512] [--repeats 7] [--out results.json]

Two tables, default kernels (plain nn.Linear, MKL) against the engine's (q|k|v and gate|up
fused, weights prepacked for oneDNN: models/linear.py):
- the demo target's linear layers, the 12 layers' products in a row (each layer its own
  weights, so they come from memory as in a real step), by rows M;
- whole steps of the demo target (its committed weights) at a `context`-token context, M new
  tokens per sequence, with the ratio to the one-token step of the same kernels and the
  largest logit difference between the two kernels.
Medians of `repeats` rounds; within a round the Ms and the two kernels are interleaved.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from bench.common import timed
from bench.model_step import OursDecode
from engine.builder import DEMO_DIR
from models.linear import PackedLinear
from models.llama import LlamaModel, prepare_for_inference
from models.loader import load_model

ROWS = (1, 2, 3, 4, 5, 6, 8, 12, 16)


def layer_products(model: LlamaModel, rows: int) -> dict[str, Callable[[], object]]:
    """Both kernels' products of every layer's linears for `rows` input rows."""
    cfg = model.config
    x = {cfg.hidden_size: torch.randn(rows, cfg.hidden_size)}
    x[cfg.intermediate_size] = torch.randn(rows, cfg.intermediate_size)
    plain = [
        lin
        for layer in model.layers
        for lin in (
            *(layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj),
            *(layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj),
            layer.mlp.down_proj,
        )
    ]
    packed = [
        PackedLinear(group)
        for layer in model.layers
        for group in (
            [layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj],
            [layer.self_attn.o_proj],
            [layer.mlp.gate_proj, layer.mlp.up_proj],
            [layer.mlp.down_proj],
        )
    ]
    return {
        "default": lambda: [F.linear(x[lin.in_features], lin.weight) for lin in plain],
        "engine": lambda: [lin(x[lin.weight.shape[1]]) for lin in packed],
    }


def interleaved(runs: dict[Any, Callable[[], object]], repeats: int) -> dict[Any, float]:
    """Median seconds of each run over `repeats` rounds (round 0 warms up)."""
    times: dict[Any, list[float]] = {key: [] for key in runs}
    for i in range(repeats + 1):
        for key in sorted(runs, key=str, reverse=i % 2 == 1):
            times[key].append(timed(runs[key]))
    return {key: statistics.median(values[1:]) for key, values in times.items()}


def bench_layers(model: LlamaModel, repeats: int) -> list[dict[str, Any]]:
    runs = {}
    for m in ROWS:
        for kernel, fn in layer_products(model, m).items():
            runs[(m, kernel)] = fn
    medians = interleaved(runs, repeats)
    return [
        {
            "rows": m,
            "default_ms": round(medians[(m, "default")] * 1e3, 3),
            "engine_ms": round(medians[(m, "engine")] * 1e3, 3),
        }
        for m in ROWS
    ]


def bench_steps(
    plain: LlamaModel, prepared: LlamaModel, batch: int, context: int, repeats: int
) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(plain.config.vocab_size, (batch, context), generator=gen)
    decoders = {"default": OursDecode(plain, prompts), "engine": OursDecode(prepared, prompts)}
    runs, diffs = {}, {}
    for m in ROWS:
        ids = torch.randint(plain.config.vocab_size, (batch * m,), generator=gen)
        for kernel, dec in decoders.items():
            # the step rewrites the context's last m positions: attention spans `context` keys
            runs[(m, kernel)] = lambda d=dec, ids=ids, m=m: d.forward(d.tables, ids, context - m)
        diffs[m] = (runs[(m, "default")]() - runs[(m, "engine")]()).abs().max().item()
    medians = interleaved(runs, repeats)
    rows = []
    for m in ROWS:
        row: dict[str, Any] = {"batch": batch, "context": context, "tokens_per_seq": m}
        for kernel in decoders:
            row[f"{kernel}_ms"] = round(medians[(m, kernel)] * 1e3, 3)
            row[f"{kernel}_ratio"] = round(medians[(m, kernel)] / medians[(1, kernel)], 3)
        row["max_abs_logit_diff"] = diffs[m]
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the cores here)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")
    if args.context <= max(ROWS):
        parser.error(f"--context must exceed {max(ROWS)}")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with torch.inference_mode():
        plain = load_model(DEMO_DIR / "target", torch.float32, torch.device("cpu"))
        prepared = copy.deepcopy(plain)
        prepare_for_inference(prepared)
        layers = bench_layers(plain, args.repeats)
        steps = [bench_steps(plain, prepared, b, args.context, args.repeats) for b in args.batches]

    print(f"demo target linears, 12 layers, ms (median of {args.repeats})")
    print(f"{'M':>3} {'default':>8} {'engine':>8}")
    for r in layers:
        print(f"{r['rows']:>3} {r['default_ms']:>8.2f} {r['engine_ms']:>8.2f}")
    print(f"\ndemo target step, context {args.context}: ms (ratio to the one-token step)")
    print(f"{'batch':>5} {'M':>3} {'default':>15} {'engine':>15} {'max |dlogit|':>13}")
    for r in (r for rows in steps for r in rows):
        print(
            f"{r['batch']:>5} {r['tokens_per_seq']:>3} "
            f"{r['default_ms']:>8.2f} ({r['default_ratio']:.2f}x) "
            f"{r['engine_ms']:>8.2f} ({r['engine_ratio']:.2f}x) {r['max_abs_logit_diff']:>13.2e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"threads": args.threads, "layers": layers, "steps": steps}, f, indent=2)


if __name__ == "__main__":
    main()
