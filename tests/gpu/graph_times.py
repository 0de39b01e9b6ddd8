"""CUDA graphs against eager forwards, for a SmolLM2-135M-shaped model in bfloat16 on CUDA.

    python tests/gpu/graph_times.py [--repeats 20] [--tokens 64]

First the forwards, synchronised, eager and graphed in turn, median of `--repeats` each, over
a 512-token context with the torch attention backend: a decode (one row a sequence), a verify
of 5 rows, and an EAGLE head's draft step (one row), at batch 1 and 16. Then the whole engine,
`--cuda-graphs` off and on in turn: tokens a second at batch 1 and 16 for plain decoding and
MTP's one-token mode (whose step is one graph with graphs on: engine/step_graph.py), its
decode steps a second, the kernel and graph launches a step (counted by the profiler on
CUDA), and each step graph's capture time and memory. Random weights of SmolLM2-135M-Instruct's
shapes (no model travels to a GPU machine; a forward's time does not depend on the weights'
values); they accept almost no draft, so a one-token-mode step emits about one token a
sequence.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import statistics
import tempfile
import time
from pathlib import Path

import torch

from core.params import SamplingParams
from engine.config import EngineConfig, KVConfig, SpecConfig
from engine.engine import AsyncEngine
from kv.cache import KVCache
from models.attention import TorchPagedAttention
from models.eagle import EagleHead
from models.graphs import GraphedForward
from models.llama import LlamaModel, prepare_for_inference
from models.loader import save_pretrained
from models.mtp import save_mtp_head
from tests.gpu.step_times import PAGE_SIZE, SMOLLM2, forward_inputs
from tests.tiny import random_mtp_head, write_tokenizer

CONTEXT = 512


def timed_pair(eager, graphed, repeats: int, device: torch.device) -> tuple[float, float]:
    """Median ms of each call, synchronised, the two in turn (after a first call of each)."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    times: tuple[list[float], list[float]] = ([], [])
    for call in (eager, graphed):
        call()
    for _ in range(repeats):
        for call, out in zip((eager, graphed), times, strict=True):
            sync()
            start = time.perf_counter()
            call()
            sync()
            out.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


def forward_rows(args, dtype: torch.dtype, device: torch.device) -> list[str]:
    model = LlamaModel(SMOLLM2).to(device, dtype)
    prepare_for_inference(model)
    head = EagleHead(SMOLLM2, model, norms=True, fc_bias=False).to(device, dtype)
    pages = -(-(CONTEXT + 5) // PAGE_SIZE)
    scratch_page = max(args.batches) * pages  # graphs' padding rows write here
    cfg = SMOLLM2

    def cache(layers: int) -> KVCache:
        shape = (cfg.num_kv_heads, cfg.head_dim, dtype, device)
        kv = KVCache(layers, scratch_page + 1, PAGE_SIZE, *shape)
        kv.data.normal_()
        return kv

    target_cache, head_cache = cache(cfg.num_layers), cache(1)

    def target(ids, positions, meta):
        hidden, _ = model(ids, positions, TorchPagedAttention(meta, target_cache, cfg.num_heads))
        return (model.logits(hidden),)

    def head_step(ids, positions, meta, features):
        attn = TorchPagedAttention(meta, head_cache, cfg.num_heads)
        hidden = head(ids, features, positions, attn)
        return (head.logits(hidden),)

    rows = []
    scratch = scratch_page * PAGE_SIZE
    forwards = (("decode", target, 1), ("verify 5", target, 5), ("head", head_step, 1))
    for batch in args.batches:
        for name, fn, width in forwards:
            ids, positions, meta = forward_inputs(target_cache, batch, CONTEXT, width, pages)
            features = torch.randn(ids.shape[0], cfg.hidden_size, device=device, dtype=dtype)
            inputs = (ids, positions, meta, *((features,) if fn is head_step else ()))
            graphed = GraphedForward(fn, device, scratch, capture=device.type == "cuda")
            eager = functools.partial(fn, *inputs)
            ms = timed_pair(eager, functools.partial(graphed, *inputs), args.repeats, device)
            rows.append(f"| {name} | {batch} | {ms[0]:.2f} | {ms[1]:.2f} | {ms[0] / ms[1]:.1f}x |")
            print(rows[-1], flush=True)
    return rows


def write_checkpoint(root: Path) -> tuple[Path, Path]:
    """A SmolLM2-shaped target (bfloat16, random) with a small tokenizer, and an MTP head."""
    cfg = dataclasses.replace(SMOLLM2, eos_token_id=0, bos_token_id=0)
    model = LlamaModel(cfg)
    save_pretrained(model, root / "target", dtype=torch.bfloat16)
    write_tokenizer(root / "target", 320)
    save_mtp_head(random_mtp_head(model, seed=7), root / "mtp")
    return root / "target", root / "mtp"


@dataclasses.dataclass
class EngineRun:
    tokens_per_s: float
    steps_per_s: float  # decode steps: the longest request's, over the wall time
    launches: float | None  # kernel and graph launches a decode step (CUDA's runtime calls)
    captures: list  # the step graph's (key, seconds, pool bytes added), where one was made


LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch")


async def engine_run(config: EngineConfig, batch: int, tokens: int) -> EngineRun:
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    prompts = [[1 + (7 * i + j) % 300 for j in range(32)] for i in range(batch)]
    engine = AsyncEngine(config)
    await engine.start()
    cuda = torch.device(config.device).type == "cuda"
    try:
        await asyncio.gather(*(engine.generate(p, params) for p in prompts))  # warm-up, captures
        profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
        with profiler if cuda else contextlib.nullcontext():
            start = time.perf_counter()
            outs = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
            seconds = time.perf_counter() - start
        # a decode step emits its accepted drafts and one token; the prefill the first token
        usages = [out[-1].usage for out in outs]
        steps = max(u.completion_tokens - 1 - u.accepted_tokens for u in usages)
        launches = None
        if cuda:
            calls = sum(e.count for e in profiler.key_averages() if e.key in LAUNCHES)
            launches = calls / steps
        graph = engine.stages.graph
        captures = list(graph.captures) if graph is not None else []
        return EngineRun(batch * tokens / seconds, steps / seconds, launches, captures)
    finally:
        await engine.stop()


def engine_rows(args) -> list[str]:
    """Plain decoding and MTP's one-token mode, graphs off and on in turn: tokens a second
    (and steps a second, one-token mode), the launches a step, the step graph's captures."""
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        target, mtp = write_checkpoint(Path(tmp))
        for name, spec in (
            ("plain", SpecConfig("none")),
            ("mtp one-token", SpecConfig("mtp", str(mtp), num_speculative_tokens=1)),
        ):
            for batch in args.batches:
                runs = {}
                for graphs in ("off", "on"):
                    config = EngineConfig(
                        str(target),
                        spec,
                        KVConfig(num_pages=256),
                        device=args.device,
                        dtype="bfloat16",
                        attention="torch",
                        cuda_graphs=graphs,
                    )
                    runs[graphs] = asyncio.run(engine_run(config, batch, args.tokens))
                off, on = runs["off"], runs["on"]
                per_s = [("tok/s", off.tokens_per_s, on.tokens_per_s)]
                if spec.method == "mtp":
                    per_s.append(("steps/s", off.steps_per_s, on.steps_per_s))
                for unit, a, b in per_s:
                    rows.append(
                        f"| engine {name} {unit} | {batch} | {a:.0f} | {b:.0f} | {b / a:.1f}x |"
                    )
                    print(rows[-1], flush=True)
                if off.launches is not None and on.launches is not None:
                    print(
                        f"launches a decode step, {name} at {batch}: eager {off.launches:.0f}, "
                        f"graphs {on.launches:.1f}",
                        flush=True,
                    )
                for key, seconds, added in on.captures:
                    print(
                        f"step graph {key.seqs} sequences x {key.keys} keys: captured in "
                        f"{seconds:.3f} s, pool +{added / 2**20:.1f} MiB",
                        flush=True,
                    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--device", default="cuda", help="cpu: the script's dry run (no graphs)")
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(0)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu (eager buffers)"
    head = f"| {name}, bfloat16, context {CONTEXT} | batch | eager ms | graphs ms | speedup |"
    print(head + "\n|---|---|---|---|---|", flush=True)
    with torch.inference_mode(), side_stream(device):
        forward_rows(args, torch.bfloat16, device)
    engine_rows(args)


def side_stream(device: torch.device):
    """A stream other than the default one (a capture needs it); nothing on the CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return torch.cuda.stream(torch.cuda.Stream(device))


if __name__ == "__main__":
    main()
