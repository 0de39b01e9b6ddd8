"""The seeded coupling's cost per step, beside the rejection rule's.

    python -m bench.coupling [--out bench/results/coupling.json]

For a decode step verifying k = 4 drafts (5 rows a sequence) at batch 1 and 16, over the demo's
vocabulary (4,096) and SmolLM2's (49,152): the coupling's noise (drawn once a step: the drafter
draws it, the sampler reuses it), the point masses the sampler makes of the coupled rows, and,
for comparison, the rejection rule (`chain_verify` with sampled drafts) that unseeded requests
take. Medians of repeats, on the engine's compute settings (2 threads).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from core.params import SamplingParams, SamplingTensors
from stages.sampling import chain_verify, couple, coupling_noise

K = 4
REPEATS = 15


def median_ms(fn: Callable[[], object]) -> float:
    fn()
    times = []
    for _ in range(REPEATS):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def measure(batch: int, vocab: int) -> dict[str, float]:
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=16, temperature=1.0, seed=1)
    st = SamplingTensors.build([params] * batch, list(range(batch)), "cpu", vocab)
    first = torch.full((batch,), 100)
    probs = torch.randn(batch, K + 1, vocab, generator=gen).softmax(-1)
    q = torch.randn(batch, K, vocab, generator=gen).softmax(-1)
    drafts = q.argmax(-1)
    positions = first[:, None] + torch.arange(K + 1)
    noise = coupling_noise(st.seeds, positions, vocab, st.coupled)
    num_drafts = torch.full((batch,), K)
    return {
        "noise_ms": median_ms(lambda: coupling_noise(st.seeds, positions, vocab, st.coupled)),
        "point_masses_ms": median_ms(lambda: couple(probs, st, first, None, K, noise)),
        "rejection_rule_ms": median_ms(
            lambda: chain_verify(probs, drafts, q, num_drafts, st.seeds, first)
        ),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.coupling", description=__doc__)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    print("| vocab | batch | noise ms | point masses ms | coupling ms | rejection rule ms |")
    print("|---|---|---|---|---|---|")
    for vocab in (4096, 49152):
        for batch in (1, 16):
            r = {"vocab": vocab, "batch": batch, "k": K} | measure(batch, vocab)
            rows.append(r)
            total = r["noise_ms"] + r["point_masses_ms"]
            print(
                f"| {vocab} | {batch} | {r['noise_ms']:.2f} | {r['point_masses_ms']:.2f} "
                f"| {total:.2f} | {r['rejection_rule_ms']:.2f} |"
            )
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
