"""Forwards of a real checkpoint, by rows, beside their floors.

    python -m bench.forward [--model smollm2|demo|DIR] [--context 512] [--rows 1 5 9 16 32]
        [--prefill 2000] [--repeats 15] [--weights auto|float32|int8]
        [--kv-dtype auto|float32|float16]
        [--out F.json]

A forward of R rows is the target's over one sequence's paged KV cache of `context` tokens,
every row's logits computed: one row is a decode, k + 1 a verify, a tree's nodes a tree
verify. Its floor is the larger of two: the bytes a forward reads (every linear's weight once,
the embedding's one row aside, and the context's keys and values) over this machine's read
bandwidth (bench/common.py read_bandwidth), and the forward's multiply-adds (the linears',
2 x weights x rows) over its product rate (float32, or the quantized kernels' integer one).
A prefill of `--prefill` tokens into an empty cache is timed too (one chunk).

The products alone are timed too, by rows: every linear of a forward called in turn on random
rows (the weights streamed from memory, as in a forward), their multiply-adds a second beside
the same products' at `--prefill-rows` rows (a prefill's: compute-bound, each weight's chunk
read once for many rows) on the same weights in the same run.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch

from bench.common import forward_call, median_seconds, read_bandwidth, text_table, timed, write_json
from engine.builder import cache_dir, model_path
from engine.config import KV_DTYPES, WEIGHTS, EngineConfig, KVConfig, SpecConfig
from models import native
from models.linear import FusedLinear, QuantLinear, TiedEmbedding, held_bytes
from models.llama import LlamaModel, prepare_for_inference
from models.loader import load_model
from models.quant import Codes, pack_codes


def streamed_bytes(model: LlamaModel) -> int:
    """Bytes of the weights one forward reads: every product's (the lm_head's included) and
    the norms'; of an embedding table of its own, one row (so: all it holds, less the rest)."""
    embed = model.embed_tokens
    if isinstance(embed, TiedEmbedding) and embed.head is not model.lm_head:
        return held_bytes(model) - held_bytes(embed)  # a quantized table of its own
    table = getattr(embed, "weight", None)
    untied = table.numel() * table.element_size() if table is not None else 0
    return held_bytes(model) - untied


def linear_weights(model: LlamaModel) -> int:
    """Multiply-adds of one row through the linears (the lm_head's included: a verify's rows
    all want logits)."""
    products = (m for m in model.modules() if isinstance(m, FusedLinear | QuantLinear))
    return sum(m.out_features * m.in_features for m in products)


def kv_bytes(model: LlamaModel, context: int, element_size: int = 4) -> int:
    """Bytes of keys and values a row's attention reads over `context` tokens."""
    cfg = model.config
    return 2 * cfg.num_layers * context * cfg.num_kv_heads * cfg.head_dim * element_size


def product_flops(quantized: bool, repeats: int = 5) -> float:
    """This machine's product rate in multiply-adds x 2 a second, over weights the cache holds
    (so that the weights' stream does not count twice): for float32 weights the better of
    torch's large matrix product and the native kernels' blocked product; for quantized ones
    the native quantized product's (4-bit codes, 64 rows)."""
    if quantized:
        shape = (4096, 1024)  # 2 MB of 4-bit codes: the caches hold them
        codes = Codes(
            torch.randint(0, 16, shape, dtype=torch.uint8),
            torch.rand(4096, 32),
            torch.rand(4096, 32),
            4,
            False,
        )
        x, packed = torch.randn(64, 1024), pack_codes(codes)
        fn = lambda: native.qlinear(x, packed, shape, codes.form)  # noqa: E731
        return 2 * 64 * shape[0] * shape[1] / median_seconds(fn, repeats * 4)
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    calls = [(lambda: a @ b, 2 * 2048**3)]
    if native.available():
        x, w = torch.randn(64, 512), native.blocked(torch.randn(256, 512))
        calls.append((lambda: native.linear(x, w, 256), 2 * 64 * 512 * 256))
    return max(flop / median_seconds(fn, repeats * 20) for fn, flop in calls)


def product_rates(model: LlamaModel, rows: list[int], repeats: int) -> dict[int, float]:
    """Multiply-adds a second of all of a forward's products (the lm_head's included) called in
    turn on `rows` random rows, for each row count (interleaved, medians)."""
    table_only = {id(m) for m in model.embed_tokens.modules()} - {
        id(m) for m in model.lm_head.modules()
    }  # an embedding's own quantized table: read a row a token, not a product
    products = [
        m
        for m in model.modules()
        if isinstance(m, FusedLinear | QuantLinear) and id(m) not in table_only
    ]
    macs = sum(m.out_features * m.in_features for m in products)
    inputs = {r: {m.in_features: torch.randn(r, m.in_features) for m in products} for r in rows}
    calls = {r: lambda r=r: [m(inputs[r][m.in_features]) for m in products] for r in rows}
    times: dict[int, list[float]] = {r: [] for r in rows}
    for fn in calls.values():
        fn()
    for _ in range(repeats):
        for r, fn in calls.items():
            times[r].append(timed(fn))
    return {r: r * macs / statistics.median(times[r]) for r in rows}


def measure(
    model: str,
    context: int,
    rows: list[int],
    prefill: int,
    repeats: int,
    weights: str = "auto",
    kv_dtype: str = "auto",
    prefill_rows: int = 256,
) -> dict:
    torch.manual_seed(0)
    config = EngineConfig(model, SpecConfig("none"), KVConfig(dtype=kv_dtype), weights=weights)
    kv = getattr(torch, config.kv_torch_dtype)
    with torch.inference_mode():
        path = model_path(config.model)
        dtype = getattr(torch, config.torch_dtype)
        target = load_model(path, dtype, torch.device("cpu"), cache_dir(), None, config.quantized)
        prepare_for_inference(target, int8=weights == "int8")
        vocab = target.config.vocab_size
        prefill_s = timed(forward_call(target, vocab, 1, 0, prefill, True, kv))
        calls = {r: forward_call(target, vocab, 1, context, r, kv_dtype=kv) for r in rows}
        for fn in calls.values():
            fn()
        times: dict[int, list[float]] = {r: [] for r in rows}
        for _ in range(repeats):  # interleaved: the machine's drift touches all alike
            for r, fn in calls.items():
                times[r].append(timed(fn))
        rates = product_rates(target, [*rows, prefill_rows], max(3, repeats // 3))
    quantized = any(isinstance(m, QuantLinear) for m in target.modules())
    bandwidth, flops = read_bandwidth(), product_flops(quantized)
    kv_read = kv_bytes(target, context, kv.itemsize)
    streamed = streamed_bytes(target) + kv_read
    per_row = 2 * linear_weights(target)
    result = {"model": model, "weights": weights, "context": context,
              "quantized_path": native.quant_path() if quantized else None,
              "weight_bytes": streamed_bytes(target), "kv_bytes": kv_read, "kv_dtype": str(kv),
              "bandwidth_bytes_per_s": bandwidth, "flop_per_s": flops,
              "prefill_tokens": prefill, "prefill_ms": prefill_s * 1e3,
              "prefill_rows": prefill_rows, "prefill_mac_per_s": rates[prefill_rows],
              "rows": {}}  # fmt: skip
    for r in rows:
        floor = max(streamed / bandwidth, per_row * r / flops)
        ms = statistics.median(times[r]) * 1e3
        result["rows"][r] = {"ms": ms, "floor_ms": floor * 1e3, "mac_per_s": rates[r]}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, demo or a directory")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 16, 32])
    parser.add_argument("--prefill", type=int, default=2000, help="tokens of the timed prefill")
    parser.add_argument("--prefill-rows", type=int, default=256, help="rows of the products'")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--weights", choices=WEIGHTS, default="auto", help="server.py's --weights")
    parser.add_argument("--kv-dtype", choices=KV_DTYPES, default="auto", help="server.py's")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    r = measure(
        args.model,
        args.context,
        args.rows,
        args.prefill,
        args.repeats,
        args.weights,
        args.kv_dtype,
        args.prefill_rows,
    )
    print(
        f"weights {r['weight_bytes'] / 1e6:.0f} MB (path {r['quantized_path'] or 'float'}), "
        f"KV {r['kv_bytes'] / 1e6:.0f} MB, {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
        f"{r['flop_per_s'] / 1e9:.0f} GOP/s; prefill of {r['prefill_tokens']} tokens "
        f"{r['prefill_ms']:.0f} ms; products at {r['prefill_rows']} rows "
        f"{r['prefill_mac_per_s'] / 1e9:.0f} GMAC/s"
    )
    one = r["rows"][min(r["rows"])]["ms"]
    table = [[str(rows), f"{v['ms']:.1f}", f"{v['floor_ms']:.1f}", f"{v['ms'] / v['floor_ms']:.2f}",
              f"{v['ms'] / one:.2f}", f"{v['mac_per_s'] / 1e9:.0f}",
              f"{v['mac_per_s'] / r['prefill_mac_per_s']:.2f}"]
             for rows, v in r["rows"].items()]  # fmt: skip
    header = ["rows", "ms", "floor ms", "x floor", "x one row", "products GMAC/s", "x prefill's"]
    print(text_table(header, table))
    if args.out:
        write_json(args.out, r)


if __name__ == "__main__":
    main()
