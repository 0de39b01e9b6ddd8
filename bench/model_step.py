"""One decode step of our paged forward against transformers' eager Llama, same weights.

python -m bench.model_step [--out results.json] [--repeats 7] [--context 512]

The model is shaped like the demo target, with random weights. Each batch size first prefills
`context` tokens per sequence in both implementations, then times one decode step, the two
interleaved, repeat after repeat; our step includes building its attention metadata, as the
engine does once per step, and both compute logits for the last token only. Between repeats the
decode's KV is dropped again (transformers: crop the DynamicCache; ours: the step rewrites the
same slot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import warnings
from dataclasses import asdict
from typing import Any

import torch
import transformers

from bench.common import paged_attention, paged_tables, timed
from kv.cache import KVCache
from kv.table import PageTable
from models.llama import LlamaConfig, LlamaModel

PAGE_SIZE = 16
DEMO_TARGET = LlamaConfig(
    vocab_size=4096,
    hidden_size=384,
    intermediate_size=1024,
    num_layers=12,
    num_heads=6,
    num_kv_heads=2,
)


def hf_twin(model: LlamaModel) -> transformers.LlamaForCausalLM:
    """transformers' eager LlamaForCausalLM holding the same weights."""
    cfg = model.config
    fields: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope_theta,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        attn_implementation="eager",
    )
    hf_cfg = transformers.LlamaConfig(**fields)
    twin = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {
        (name if name.startswith("lm_head") else f"model.{name}"): tensor
        for name, tensor in model.state_dict().items()
    }
    twin.load_state_dict(state, strict=True)
    return twin


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

    def forward(self, tables: list[PageTable], ids: torch.Tensor, start: int) -> torch.Tensor:
        """Each table's sequence gets len(ids) // len(tables) tokens from `start` on; [B, vocab]."""
        q_len = ids.shape[0] // len(tables)
        attn, positions = paged_attention(
            tables, self.cache, self.model.config.num_heads, start, q_len
        )
        hidden, _ = self.model(ids, positions, attn)
        return self.model.logits(hidden[q_len - 1 :: q_len])

    def step(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [B]
        return self.forward(self.tables, tokens, start=self.context)


class HFDecode:
    """transformers' forward with its DynamicCache prefilled with the same prompts."""

    def __init__(self, model: transformers.LlamaForCausalLM, prompts: torch.Tensor):
        self.model = model
        self.cache = transformers.DynamicCache()
        model(prompts, past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        self.context = prompts.shape[1]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:  # tokens [B]
        batch = tokens.shape[0]
        position_ids = torch.full((batch, 1), self.context)
        out = self.model(
            tokens[:, None],
            position_ids=position_ids,
            past_key_values=self.cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return out.logits[:, -1]

    def rewind(self) -> None:
        self.cache.crop(-1)  # drop the decoded token's KV


def bench_batch(
    model: LlamaModel, twin: transformers.LlamaForCausalLM, batch: int, context: int, repeats: int
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(batch)
    vocab = model.config.vocab_size
    prompts = torch.randint(vocab, (batch, context), generator=gen)
    tokens = torch.randint(vocab, (batch,), generator=gen)
    ours, theirs = OursDecode(model, prompts), HFDecode(twin, prompts)
    diff = (ours.step(tokens) - theirs.step(tokens)).abs().max().item()
    theirs.rewind()
    times: dict[str, list[float]] = {"ours": [], "transformers": []}
    runs = {"ours": lambda: ours.step(tokens), "transformers": lambda: theirs.step(tokens)}
    for i in range(repeats + 1):  # round 0 warms up; the order alternates between rounds
        for name in sorted(runs, reverse=i % 2 == 1):
            times[name].append(timed(runs[name]))
        theirs.rewind()
    row: dict[str, Any] = {"batch": batch, "context": context}
    for name, values in times.items():
        row[f"{name}_ms"] = round(statistics.median(values[1:]) * 1e3, 3)
        row[f"{name}_min_ms"] = round(min(values[1:]) * 1e3, 3)
    row["speedup"] = round(row["transformers_ms"] / row["ours_ms"], 3)
    row["max_abs_logit_diff"] = diff
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--repeats", type=int, default=7, help="timed rounds (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (the cores here)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5")

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers renaming arguments
    with torch.inference_mode():
        model = LlamaModel(DEMO_TARGET).eval()
        twin = hf_twin(model)
        rows = [bench_batch(model, twin, b, args.context, args.repeats) for b in args.batches]

    print(
        f"decode step, context {args.context}, {args.threads} threads, "
        f"median of {args.repeats} interleaved repeats"
    )
    print(
        f"{'batch':>5} {'ours ms':>9} {'transformers ms':>16} {'speedup':>8} {'max |dlogit|':>13}"
    )
    for r in rows:
        print(
            f"{r['batch']:>5} {r['ours_ms']:>9.2f} {r['transformers_ms']:>16.2f} "
            f"{r['speedup']:>7.2f}x {r['max_abs_logit_diff']:>13.2e}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(
                {"model": asdict(DEMO_TARGET), "threads": args.threads, "results": rows},
                f,
                indent=2,
            )


if __name__ == "__main__":
    main()
