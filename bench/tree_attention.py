"""What a tree costs to verify with the torch backend, as the context grows.

python -m bench.tree_attention [--nodes 16] [--batch 1] [--repeats 20] [--threads 2]
    [--sizes 0 2 4 8 16 32] [--verify-contexts 512 2048] [--out results.json]

1. One attention layer shaped like the demo target (6 query heads, 2 KV heads, head_dim 64):
   `nodes + 1` query rows per sequence (the root and the nodes) over `context` cached keys
   plus their own, three ways:
   - causal: the rows form a chain (the existing causal-by-position rule);
   - full mask: a random tree, one custom mask over the whole sequence
     (`AttentionMetadata.mask`, what the engine uses);
   - cascade: the prefix without a mask plus the tree part with its small mask, merged by
     log-sum-exp (the form FlashInfer offers as cascade attention).
   Each timing includes building what the call needs (mask, gather rows), as the engine does
   once per forward.
2. The demo target's whole verify forward over a tree of N nodes (N + 1 rows, the tree mask)
   at a few contexts, N = 0 being a plain one-token decode step: what the default tree size
   trades against.

Medians of `repeats` runs, the variants interleaved.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from kv.cache import KVCache
from models.attention import AttentionMetadata, TorchPagedAttention
from models.llama import prepare_for_inference
from models.loader import load_model

PAGE_SIZE = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64  # the demo target's attention
CONTEXTS = (256, 512, 1024, 2048, 4096)
DEMO_TARGET = Path(__file__).resolve().parent.parent / "models" / "demo" / "target"


def random_parents(nodes: int, generator: torch.Generator) -> list[int]:
    """A random tree: each node's parent is an earlier node or the root (-1)."""
    return [int(torch.randint(-1, i, (1,), generator=generator)) for i in range(nodes)]


def tree_rows(parents: list[int]) -> torch.Tensor:
    """[N + 1, N] bool: which nodes verify row r sees (row 0, the root: none)."""
    n = len(parents)
    rows = torch.zeros(n + 1, n, dtype=torch.bool)
    for i, parent in enumerate(parents):
        if parent >= 0:
            rows[1 + i] = rows[1 + parent]
        rows[1 + i, i] = True
    return rows


def metadata(batch: int, context: int, parents: list[int] | None, nodes: int) -> AttentionMetadata:
    """Sequence b owns slots [b * span, b * span + context + 1 + nodes) (span whole pages);
    its root sits at position `context`, node i at context + depth, slot context + 1 + i."""
    total = context + 1 + nodes
    span = -(-total // PAGE_SIZE) * PAGE_SIZE
    starts = torch.arange(batch)[:, None] * span  # [B, 1]
    kv_slots = starts + torch.arange(total)[None]  # [B, total]
    mask, depth = None, torch.arange(nodes + 1)
    if parents is not None:
        rows = tree_rows(parents)
        prefix = torch.ones(nodes + 1, context + 1, dtype=torch.bool)
        mask = torch.cat([prefix, rows], 1)[None].expand(batch, -1, -1)  # [B, N + 1, total]
        depth = rows.sum(1)
    return AttentionMetadata(
        slot_mapping=kv_slots[:, context:].flatten(),
        kv_slots=kv_slots,
        kv_lens=torch.full((batch,), total),
        q_index=torch.arange(batch * (nodes + 1)),
        q_positions=(context + depth)[None].expand(batch, -1),
        mask=mask,
    )


class CascadeAttention:
    """The prefix (keys 0 .. context, root included) by SDPA without a mask, the tree part
    (the N node keys) with the small mask, merged by log-sum-exp. Batch of equal contexts."""

    def __init__(self, meta: AttentionMetadata, cache: KVCache, rows: torch.Tensor, context: int):
        self.meta, self.cache, self.prefix = meta, cache, context + 1
        ps = cache.page_size
        read = cache.key_rows(meta.kv_slots).flatten()
        self.read_rows = torch.cat((read, read + ps))
        write = cache.key_rows(meta.slot_mapping)
        self.write_rows = (write, write + ps)
        group = Q_HEADS // KV_HEADS
        q = rows.shape[0]
        self.tree_mask = rows[None, None, :, None].expand(1, 1, q, group, -1)  # [1,1,Q,G,N]
        self.tree_mask = self.tree_mask.transpose(2, 3).reshape(1, 1, group * q, -1)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        store = self.cache.layer_rows(layer)
        store[self.write_rows[0]] = k
        store[self.write_rows[1]] = v
        b, lmax = self.meta.kv_slots.shape
        qrows, group = q.shape[0] // b, Q_HEADS // KV_HEADS
        kv = torch.index_select(store, 0, self.read_rows)  # the gather the backend uses
        kv = kv.view(2, b, lmax, KV_HEADS, HEAD_DIM).transpose(2, 3)
        keys, values = kv[0], kv[1]  # [B, Hkv, L, D]
        qg = q.view(b, qrows, KV_HEADS, group, HEAD_DIM).permute(0, 2, 3, 1, 4)
        qg = qg.reshape(b, KV_HEADS, group * qrows, HEAD_DIM)
        p = self.prefix
        sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
        out1, lse1 = sdpa(qg, keys[:, :, :p], values[:, :, :p])[:2]
        scores = qg @ keys[:, :, p:].transpose(-1, -2) / math.sqrt(HEAD_DIM)
        scores = scores.masked_fill(~self.tree_mask, float("-inf"))
        lse2 = torch.logsumexp(scores, -1)  # -inf for the root's rows: no tree keys
        out2 = (scores - lse2[..., None]).exp().nan_to_num() @ values[:, :, p:]
        top = torch.maximum(lse1, lse2)
        w1, w2 = (lse1 - top).exp(), (lse2 - top).exp()
        out = (out1 * w1[..., None] + out2 * w2[..., None]) / (w1 + w2)[..., None]
        out = out.view(b, KV_HEADS, group, qrows, HEAD_DIM).permute(0, 3, 1, 2, 4)
        return out.reshape(-1, Q_HEADS, HEAD_DIM)


def median_ms(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Interleaved timings, the first two runs warming up."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats + 2):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: 1e3 * statistics.median(t[2:]) for name, t in times.items()}


def attention_row(batch: int, context: int, nodes: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(context)
    span = -(-(context + 1 + nodes) // PAGE_SIZE)
    cache = KVCache(1, batch * span, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache.data.normal_(generator=generator)
    t = batch * (nodes + 1)
    qkv = (
        torch.randn(t, Q_HEADS, HEAD_DIM, generator=generator),  # q [T, Hq, D]
        torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator),  # k [T, Hkv, D]
        torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator),  # v [T, Hkv, D]
    )
    parents = random_parents(nodes, generator)
    causal, tree = metadata(batch, context, None, nodes), metadata(batch, context, parents, nodes)
    rows = tree_rows(parents)
    full = lambda: TorchPagedAttention(tree, cache, Q_HEADS)(0, *qkv)
    cascade = lambda: CascadeAttention(tree, cache, rows, context)(0, *qkv)
    torch.testing.assert_close(cascade(), full(), atol=1e-4, rtol=1e-4)
    ms = median_ms(
        {
            "causal": lambda: TorchPagedAttention(causal, cache, Q_HEADS)(0, *qkv),
            "full_mask": full,
            "cascade": cascade,
        },
        repeats,
    )
    return {"context": context, **{f"{name}_ms": value for name, value in ms.items()}}


def verify_row(model, context: int, sizes: list[int], repeats: int) -> dict:
    """ms of the demo target's forward over a tree of N nodes (N + 1 rows) at `context`."""
    cfg = model.config
    generator = torch.Generator().manual_seed(context)
    span = -(-(context + 1 + max(sizes)) // PAGE_SIZE)
    cache = KVCache(cfg.num_layers, span, PAGE_SIZE, cfg.num_kv_heads, cfg.head_dim)
    cache.data.normal_(generator=generator)
    fns = {}
    for n in sizes:
        meta = metadata(1, context, random_parents(n, generator) if n else None, n)
        ids = torch.randint(0, cfg.vocab_size, (n + 1,), generator=generator)
        positions = meta.q_positions.flatten()

        def forward(meta=meta, ids=ids, positions=positions) -> None:
            attn = TorchPagedAttention(meta, cache, cfg.num_heads)
            hidden, _ = model(ids, positions, attn)
            model.logits(hidden)

        fns[str(n)] = forward
    ms = median_ms(fns, repeats)
    return {"context": context, "ms_by_nodes": {int(n): v for n, v in ms.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16, help="tree nodes per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2, help="torch threads (shared cores)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[0, 2, 4, 8, 12, 16, 24, 32])
    parser.add_argument("--verify-contexts", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--out", help="also write the results as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with torch.inference_mode():
        rows = [attention_row(args.batch, c, args.nodes, args.repeats) for c in CONTEXTS]
        model = load_model(DEMO_TARGET)
        prepare_for_inference(model)
        verify = [verify_row(model, c, args.sizes, args.repeats) for c in args.verify_contexts]
    print(
        f"one attention layer, batch {args.batch}, {args.nodes} nodes + root, "
        f"{args.threads} threads, median ms"
    )
    print(f"{'context':>8} {'causal':>9} {'full mask':>10} {'cascade':>9} {'cascade/full':>13}")
    for r in rows:
        ratio = r["cascade_ms"] / r["full_mask_ms"]
        print(
            f"{r['context']:>8} {r['causal_ms']:>9.3f} {r['full_mask_ms']:>10.3f} "
            f"{r['cascade_ms']:>9.3f} {ratio:>13.2f}"
        )
    print("\ndemo target verify forward over N tree nodes (N + 1 rows), batch 1, median ms")
    print(f"{'context':>8} " + " ".join(f"{f'N={n}':>8}" for n in args.sizes))
    for v in verify:
        print(f"{v['context']:>8} " + " ".join(f"{v['ms_by_nodes'][n]:>8.2f}" for n in args.sizes))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "attention": rows, "verify": verify}, f, indent=2)


if __name__ == "__main__":
    main()
