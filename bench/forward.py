"""One forward of a real checkpoint beside its memory-bandwidth floor.

    python -m bench.forward --model DIR [--context 512] [--repeats 15] [--quantization int8]
        [--out F.json]

"A forward" is the target's one-token decode at batch 1 over a `context`-token paged KV
cache (prefilled first); a verify of k + 1 rows over the same context is timed too. The
model's weights are far larger than the last-level cache, so each forward streams them from
memory, as in serving. The floor is the weight bytes read by a forward (every linear once,
the embedding's one row aside) over this machine's read bandwidth (bench/bandwidth.py).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from bench.bandwidth import floor_seconds, measure_bandwidth
from bench.common import text_table, timed
from bench.model_step import OursDecode
from models.linear import Int8Linear, PackedLinear
from models.llama import LlamaModel, RMSNorm, prepare_for_inference
from models.loader import load_model


def streamed_bytes(model: LlamaModel) -> int:
    """Bytes of the weights one forward reads: every linear's (the lm_head's included, tied
    to the embedding or not; int8 weights with their scales) and the norms'; of the
    embedding table, one row."""
    tensors: dict[int, torch.Tensor] = {}
    for module in model.modules():
        if isinstance(module, Int8Linear):
            read = module.blocked if module.blocked is not None else module.weight
            parts = [read, module.bias, module.scales]
        elif isinstance(module, PackedLinear):
            parts = [module.weight, module.bias]
        elif isinstance(module, RMSNorm):
            parts = [module.weight]
        else:
            continue
        tensors |= {t.data_ptr(): t for t in parts if t is not None}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def measure(model_dir: Path, context: int, repeats: int, k: int, int8: bool = False) -> dict:
    torch.manual_seed(0)
    with torch.inference_mode():
        model = load_model(model_dir, torch.float32, torch.device("cpu"))
        prepare_for_inference(model, int8=int8)
        vocab = model.config.vocab_size
        decode = OursDecode(model, torch.randint(0, vocab, (1, context)))
        one, rows = torch.randint(0, vocab, (1,)), torch.randint(0, vocab, (k + 1,))
        verify = lambda: decode.forward(decode.tables, rows, start=decode.context)  # noqa: E731
        step = lambda: decode.step(one)  # noqa: E731
        for fn in (step, verify):
            fn()
        times: dict[str, list[float]] = {"decode": [], "verify": []}
        for _ in range(repeats):  # interleaved: the machine's drift touches both alike
            times["decode"].append(timed(step))
            times["verify"].append(timed(verify))
    weights = streamed_bytes(model)
    bandwidth = measure_bandwidth()
    floor = floor_seconds(weights, bandwidth)
    decode_s = statistics.median(times["decode"])
    return {
        "model": str(model_dir),
        "quantization": "int8" if int8 else None,
        "context": context,
        "weight_bytes": weights,
        "bandwidth_bytes_per_s": bandwidth,
        "floor_ms": floor * 1e3,
        "decode_ms": decode_s * 1e3,
        "verify_ms": statistics.median(times["verify"]) * 1e3,
        "verify_rows": k + 1,
        "decode_over_floor": decode_s / floor,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, required=True, help="a Hugging Face directory")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--k", type=int, default=4, help="draft tokens of the timed verify")
    parser.add_argument("--quantization", choices=["int8"], help="weight-only int8 linears")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    r = measure(args.model, args.context, args.repeats, args.k, args.quantization == "int8")
    header = ["weights MB", "GB/s", "floor ms", "decode ms", "x floor", "verify ms"]
    row = [
        f"{r['weight_bytes'] / 1e6:.0f}",
        f"{r['bandwidth_bytes_per_s'] / 1e9:.1f}",
        f"{r['floor_ms']:.1f}",
        f"{r['decode_ms']:.1f}",
        f"{r['decode_over_floor']:.2f}",
        f"{r['verify_ms']:.1f} ({r['verify_rows']} rows)",
    ]
    print(text_table(header, [row]))
    if args.out:
        args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
