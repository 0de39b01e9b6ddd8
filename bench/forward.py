"""Forwards of a real checkpoint, by rows, beside their floors.

    python -m bench.forward [--model smollm2|demo|DIR] [--context 512] [--rows 1 5 9 16 32]
        [--prefill 2000] [--repeats 15] [--quantization int8] [--out F.json]
    python -m bench.forward --mla 1024 4096     # MLA's absorbed and expanded decode

A forward of R rows is the target's over one sequence's paged KV cache of `context` tokens:
one row is a decode, k + 1 a verify, a tree's nodes a tree verify. Its floor is the larger of
two: the weight bytes a forward reads (every linear once, the embedding's one row aside) over
this machine's read bandwidth (bench/bandwidth.py), and the forward's multiply-adds (the
linears', 2 x weights x rows) over its float32 product rate (a large matrix product's, here).
A prefill of `--prefill` tokens into an empty cache is timed too (one chunk).
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time
from pathlib import Path

import torch

from bench.bandwidth import floor_seconds, measure_bandwidth
from bench.common import paged_attention, paged_tables, text_table, timed
from engine.builder import cache_dir, model_path
from kv.cache import KVCache
from kv.table import PageTable
from models import native
from models.attention import TorchPagedAttention
from models.linear import FusedLinear, held_bytes
from models.llama import LlamaModel, prepare_for_inference
from models.loader import load_model

PAGE_SIZE = 16


class OursDecode:
    """Our forward over a paged cache already holding `context` tokens of each sequence."""

    def __init__(self, model: LlamaModel, prompts: torch.Tensor):  # prompts [B, context]
        cfg = model.config
        batch, self.context = prompts.shape
        allocator, self.tables = paged_tables(batch, self.context + 1, PAGE_SIZE)
        self.model = model
        self.cache = KVCache(
            cfg.num_layers, allocator.num_pages, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim
        )
        for table, prompt in zip(self.tables, prompts, strict=True):  # prefill one by one
            self.forward([table], prompt, start=0)

    def forward(
        self, tables: list[PageTable], ids: torch.Tensor, start: int, every_row: bool = False
    ) -> torch.Tensor:
        """Each table's sequence gets len(ids) // len(tables) tokens from `start` on; the
        logits of each sequence's last row [B, vocab], or of every row (a verify's)."""
        q_len = ids.shape[0] // len(tables)
        attn, positions = paged_attention(
            tables, self.cache, self.model.config.num_heads, start, q_len
        )
        hidden, _ = self.model(ids, positions, attn)
        return self.model.logits(hidden if every_row else hidden[q_len - 1 :: q_len])


def streamed_bytes(model: LlamaModel) -> int:
    """Bytes of the weights one forward reads: every product's (the lm_head's included) and
    the norms'; of an untied embedding table, one row (so: all it holds, less the rest)."""
    embed = getattr(model.embed_tokens, "weight", None)
    untied = embed.numel() * embed.element_size() if embed is not None else 0
    return held_bytes(model) - untied


def linear_weights(model: LlamaModel) -> int:
    """Multiply-adds of one row through the linears (the lm_head's included: a verify's rows
    all want logits)."""
    return sum(
        m.out_features * m.in_features for m in model.modules() if isinstance(m, FusedLinear)
    )


def product_flops(repeats: int = 5) -> float:
    """This machine's float32 product rate in FLOP/s: the better of torch's large matrix
    product and, where they built, the native kernels' product over weights the cache holds
    (so that the weights' stream does not count twice)."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    calls = [(lambda: a @ b, 2 * 2048**3)]
    if native.available():
        x, w = torch.randn(64, 512), native.blocked(torch.randn(256, 512))
        calls.append((lambda: native.linear(x, w, 256), 2 * 64 * 512 * 256))
    rates = []
    for fn, flop in calls:
        fn()
        rates.append(flop / statistics.median(timed(fn) for _ in range(repeats * 20)))
    return max(rates)


def measure(model: str, context: int, rows: list[int], prefill: int, repeats: int,
            int8: bool = False) -> dict:  # fmt: skip
    torch.manual_seed(0)
    with torch.inference_mode():
        path = model_path(None if model == "demo" else model)
        target = load_model(path, torch.float32, torch.device("cpu"), cache_dir())
        prepare_for_inference(target, int8=int8)
        vocab = target.config.vocab_size
        start = time.perf_counter()
        OursDecode(target, torch.randint(0, vocab, (1, prefill)))
        prefill_s = time.perf_counter() - start
        decode = OursDecode(target, torch.randint(0, vocab, (1, context + max(rows))))
        calls = {}
        for r in rows:  # the last r positions, over the cache's first context + r - 1 keys
            ids, first = torch.randint(0, vocab, (r,)), decode.context - r
            calls[r] = lambda ids=ids, first=first: decode.forward(decode.tables, ids, first, True)
        for fn in calls.values():
            fn()
        times: dict[int, list[float]] = {r: [] for r in rows}
        for _ in range(repeats):  # interleaved: the machine's drift touches all alike
            for r, fn in calls.items():
                times[r].append(timed(fn))
    bandwidth, flops = measure_bandwidth(), product_flops()
    weights = streamed_bytes(target)
    per_row = 2 * linear_weights(target)
    result = {"model": model, "quantization": "int8" if int8 else None, "context": context,
              "weight_bytes": weights, "bandwidth_bytes_per_s": bandwidth, "flop_per_s": flops,
              "prefill_tokens": prefill, "prefill_ms": prefill_s * 1e3, "rows": {}}  # fmt: skip
    for r in rows:
        floor = max(floor_seconds(weights, bandwidth), per_row * r / flops)
        ms = statistics.median(times[r]) * 1e3
        result["rows"][r] = {"ms": ms, "floor_ms": floor * 1e3}
    return result


# DeepSeek-V2-Lite's attention (16 heads; the MoE left out: one small dense MLP)
MLA = {"vocab_size": 1024, "hidden_size": 2048, "intermediate_size": 256, "num_layers": 1,
       "num_heads": 16, "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
       "v_head_dim": 128}  # fmt: skip
MLA_FORMS = {  # form: (torch's attention for every forward, MLA expanded)
    "absorbed": (False, False),  # as the engine decodes: the native attention where it built
    "absorbed, torch attention": (True, False),
    "expanded": (True, True),
}


def mla_forms(contexts: list[int], repeats: int) -> list[dict]:
    """A one-token decode of one MLA layer at each context, in each form (MLA_FORMS), a
    prefill of the context in each form, and the KV bytes a token and layer beside a Llama
    layer of the same width."""
    from models.deepseek import DeepseekConfig, DeepseekModel, LatentAttention

    torch.manual_seed(0)
    cfg = DeepseekConfig(**MLA)
    with torch.inference_mode():
        model = DeepseekModel(cfg)
        for p in model.parameters():
            p.normal_(0.0, 0.02)
        attention = model.layers[0].self_attn
        assert isinstance(attention, LatentAttention)
        attention.absorb()
        prepare_for_inference(model)
        rows = []
        for context in contexts:
            prompt = torch.randint(0, cfg.vocab_size, (1, context))
            prefill = {}
            for form in ("absorbed", "expanded"):  # the prompt in one chunk, torch's attention
                attention.expanded_min_tokens = 0 if form == "expanded" else 1 << 30
                seconds = timed(functools.partial(OursDecode, model, prompt))
                prefill[f"prefill {form}"] = seconds * 1e3
            decode = OursDecode(model, prompt)
            step = functools.partial(
                decode.forward, decode.tables, torch.randint(0, cfg.vocab_size, (1,)), context - 1
            )
            times: dict[str, list[float]] = {form: [] for form in MLA_FORMS}
            for _ in range(repeats + 1):  # interleaved; the first round warms up
                for form, (torch_only, expanded) in MLA_FORMS.items():
                    TorchPagedAttention.native_max_q = -1 if torch_only else 64
                    attention.expanded_min_tokens = 0 if expanded else 1 << 30
                    times[form].append(timed(step))
            TorchPagedAttention.native_max_q, attention.expanded_min_tokens = 64, 128
            medians = {form: statistics.median(t[1:]) * 1e3 for form, t in times.items()}
            rows.append({"context": context} | medians | prefill)
    latent = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4
    llama = 2 * cfg.hidden_size * 4  # keys and values of 16 heads of 128
    print(f"KV bytes a token and layer (float32): MLA's latent and rotary key {latent}, held "
          f"twice here (as keys and as values) {2 * latent}; a Llama layer of the same width "
          f"{llama}")  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, demo or a directory")
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 5, 9, 16, 32])
    parser.add_argument("--prefill", type=int, default=2000, help="tokens of the timed prefill")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--quantization", choices=["int8"], help="weight-only int8 linears")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--mla", type=int, nargs="+", metavar="CONTEXT",
                        help="MLA's decode in each form at these contexts instead")  # fmt: skip
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    if args.mla:
        rows = mla_forms(args.mla, args.repeats)
        forms = [*MLA_FORMS, "prefill absorbed", "prefill expanded"]
        table = [[r["context"], *[f"{r[f]:.2f}" for f in forms]] for r in rows]
        print(text_table(["context", *[f + " ms" for f in forms]], table))
        return
    r = measure(args.model, args.context, args.rows, args.prefill, args.repeats,
                args.quantization == "int8")  # fmt: skip
    print(f"weights {r['weight_bytes'] / 1e6:.0f} MB, {r['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s,"
          f" {r['flop_per_s'] / 1e9:.0f} GFLOP/s; prefill of {r['prefill_tokens']} tokens "
          f"{r['prefill_ms']:.0f} ms")  # fmt: skip
    one = r["rows"][min(r["rows"])]["ms"]
    table = [[str(rows), f"{v['ms']:.1f}", f"{v['floor_ms']:.1f}", f"{v['ms'] / v['floor_ms']:.2f}",
              f"{v['ms'] / one:.2f}"] for rows, v in r["rows"].items()]  # fmt: skip
    print(text_table(["rows", "ms", "floor ms", "x floor", "x one row"], table))
    if args.out:
        args.out.write_text(json.dumps(r, indent=2) + "\n")


if __name__ == "__main__":
    main()
