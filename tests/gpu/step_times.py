"""Decode and verify forwards of a SmolLM2-135M-shaped model on CUDA, by attention backend.

    python tests/gpu/step_times.py [--dtype bfloat16] [--batches 1 16] [--contexts 512 4096]

Random weights of SmolLM2-135M-Instruct's shapes (the GGUF does not travel to a GPU machine;
a forward's time does not depend on the weights' values). A decode is one row per sequence, a
verify k + 1 = 5; each over `context` tokens already cached. Timed with the device
synchronised around each forward (median of `--repeats`), the logits of every row included.
FlashInfer's time includes its planning, which the engine does for every forward.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kv.cache import KVCache
from kv.table import PageTable, build_csr
from models.attention import TorchPagedAttention, paged_metadata
from models.llama import LlamaConfig, LlamaModel, prepare_for_inference

SMOLLM2 = LlamaConfig(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_layers=30,
    num_heads=9,
    num_kv_heads=3,
    max_position_embeddings=8192,
    tie_word_embeddings=True,
)
PAGE_SIZE = 16


def backends() -> dict:
    from models.flashinfer_backend import FlashInferBackend

    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return {"torch": TorchPagedAttention}
    return {"torch": TorchPagedAttention, "flashinfer": FlashInferBackend()}


def forward_inputs(cache, batch: int, context: int, rows: int, pages: int):
    """(ids, positions, metadata) of a forward of `rows` new tokens for each of `batch`
    sequences after `context` cached, sequence b on pages b * pages onwards."""
    device = cache.data.device
    tables = [PageTable(PAGE_SIZE, list(range(b * pages, (b + 1) * pages))) for b in range(batch)]
    end = context + rows
    csr = build_csr(tables, [end] * batch, [rows] * batch)
    positions = torch.arange(context, end, device=device).repeat(batch)
    slots = [s for t in tables for s in t.slots(context, end)]

    def ints(values):
        return torch.tensor(values, dtype=torch.int32, device=device)

    meta = paged_metadata(
        ints(csr.qo_indptr),
        ints(csr.kv_indptr),
        ints(csr.kv_indices),
        ints(csr.kv_last_page_len),
        positions,
        ints(slots),
        PAGE_SIZE,
        rows,
        end,
    )
    ids = torch.randint(0, SMOLLM2.vocab_size, (batch * rows,), device=device)
    return ids, positions, meta


def forward_call(model, cache, backend, batch: int, context: int, rows: int, pages: int):
    """A forward of `rows` new tokens for each of `batch` sequences after `context` cached."""
    ids, positions, meta = forward_inputs(cache, batch, context, rows, pages)

    def call():
        attn = backend(meta, cache, SMOLLM2.num_heads)
        hidden, _ = model(ids, positions, attn)
        return model.logits(hidden)

    return call


def timed_ms(call, repeats: int) -> float:
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--contexts", type=int, nargs="+", default=[512, 4096])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    dtype, device = getattr(torch, args.dtype), torch.device("cuda")
    torch.manual_seed(0)
    with torch.inference_mode():
        model = LlamaModel(SMOLLM2).to(device, dtype)
        prepare_for_inference(model)
        pages = -(-(max(args.contexts) + 5) // PAGE_SIZE)  # a sequence's
        cfg = SMOLLM2
        cache = KVCache(
            cfg.num_layers,
            max(args.batches) * pages,
            PAGE_SIZE,
            cfg.num_kv_heads,
            cfg.head_dim,
            dtype,
            device,
        )
        cache.data.normal_()
        print(
            f"| {torch.cuda.get_device_name()}, {args.dtype} | context | batch | decode ms | "
            "verify (5 rows) ms |"
        )
        print("|---|---|---|---|---|")
        for name, backend in backends().items():
            for context in args.contexts:
                for batch in args.batches:
                    ms = [timed_ms(forward_call(model, cache, backend, batch, context, rows, pages),
                                   args.repeats) for rows in (1, 5)]  # fmt: skip
                    print(
                        f"| {name} | {context} | {batch} | {ms[0]:.2f} | {ms[1]:.2f} |", flush=True
                    )


if __name__ == "__main__":
    main()
