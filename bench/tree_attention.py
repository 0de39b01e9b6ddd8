"""Tree-masked attention (one custom mask over the whole sequence) against plain causal
attention, with the torch backend, as the context grows.

python -m bench.tree_attention [--nodes 16] [--batch 1] [--repeats 20] [--threads 1]
    [--out results.json]

One attention layer shaped like the demo target (6 query heads, 2 KV heads, head_dim 64) runs
`nodes` query tokens per sequence over `context` cached keys plus their own. Causal: the nodes
form a chain (each sees every earlier key). Tree: a random tree of `nodes` nodes (node 0 the
last committed token), each seeing the prefix, its ancestors and itself, through
`AttentionMetadata.mask` [B, nodes, context + nodes]. Both timings include building the backend
(its mask and gather rows), as the engine does once per forward; medians of `repeats` runs,
the two interleaved.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from kv.cache import KVCache
from models.attention import AttentionMetadata, TorchPagedAttention

PAGE_SIZE = 16
Q_HEADS, KV_HEADS, HEAD_DIM = 6, 2, 64  # the demo target's attention
CONTEXTS = (256, 512, 1024, 2048, 4096)


def random_tree_mask(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[nodes, nodes] bool: node i sees itself and its ancestors (parents are earlier nodes)."""
    mask = torch.eye(nodes, dtype=torch.bool)
    for i in range(1, nodes):
        parent = int(torch.randint(0, i, (1,), generator=generator))
        mask[i] |= mask[parent]
    return mask


def metadata(batch: int, context: int, nodes: int, tree: torch.Tensor | None) -> AttentionMetadata:
    """Sequence b owns slots [b * span, b * span + context + nodes) (span whole pages)."""
    total = context + nodes
    span = -(-total // PAGE_SIZE) * PAGE_SIZE
    starts = torch.arange(batch)[:, None] * span  # [B, 1]
    kv_slots = starts + torch.arange(total)[None]  # [B, context + nodes]
    new = kv_slots[:, context:]  # [B, nodes]
    mask, depth = None, torch.arange(nodes)
    if tree is not None:
        prefix = torch.ones(nodes, context, dtype=torch.bool)
        mask = torch.cat([prefix, tree], 1)[None].expand(batch, -1, -1)  # [B, nodes, total]
        depth = tree.sum(1) - 1  # a node's rotary position is context + its depth
    return AttentionMetadata(
        slot_mapping=new.flatten(),
        kv_slots=kv_slots,
        kv_lens=torch.full((batch,), total),
        q_index=torch.arange(batch * nodes),
        q_positions=(context + depth)[None].expand(batch, -1),
        mask=mask,
    )


def time_layer(meta: AttentionMetadata, cache: KVCache, qkv: tuple[torch.Tensor, ...]) -> float:
    start = time.perf_counter()
    TorchPagedAttention(meta, cache, Q_HEADS)(0, *qkv)
    return time.perf_counter() - start


def measure(batch: int, context: int, nodes: int, repeats: int) -> dict[str, float]:
    generator = torch.Generator().manual_seed(context)
    span = -(-(context + nodes) // PAGE_SIZE)
    cache = KVCache(1, batch * span, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache.data.normal_(generator=generator)
    t = batch * nodes
    qkv = (
        torch.randn(t, Q_HEADS, HEAD_DIM, generator=generator),  # q [T, Hq, D]
        torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator),  # k [T, Hkv, D]
        torch.randn(t, KV_HEADS, HEAD_DIM, generator=generator),  # v [T, Hkv, D]
    )
    causal = metadata(batch, context, nodes, None)
    tree = metadata(batch, context, nodes, random_tree_mask(nodes, generator))
    times: dict[str, list[float]] = {"causal": [], "tree": []}
    for _ in range(repeats + 2):  # the first two warm up
        times["causal"].append(time_layer(causal, cache, qkv))
        times["tree"].append(time_layer(tree, cache, qkv))
    causal_ms = 1e3 * statistics.median(times["causal"][2:])
    tree_ms = 1e3 * statistics.median(times["tree"][2:])
    return {"context": context, "causal_ms": causal_ms, "tree_ms": tree_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=16, help="tree nodes per sequence")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (shared cores)")
    parser.add_argument("--out", help="also write the rows as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = [measure(args.batch, c, args.nodes, args.repeats) for c in CONTEXTS]
    print(f"one layer, batch {args.batch}, {args.nodes} nodes, {args.threads} threads, median ms")
    print(f"{'context':>8} {'causal':>9} {'tree':>9} {'tree/causal':>12}")
    for r in rows:
        ratio = r["tree_ms"] / r["causal_ms"]
        print(f"{r['context']:>8} {r['causal_ms']:>9.3f} {r['tree_ms']:>9.3f} {ratio:>12.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
