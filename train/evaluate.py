"""How good the demo pair is for speculative decoding, measured on held-out text.

- held-out loss of each model, and the share of positions where their argmaxes agree;
- acceptance length (tokens emitted per verify step) of greedy chain drafting with k tokens,
  by exact simulation: the target greedily continues each held-out prompt, and the draft is run
  teacher-forced over prompt + continuation. While the draft agrees with the target its own
  proposals are exactly that continuation, so the accepted count of a verify step starting at
  token i is the run of agreements from i, capped at k; the step then emits one more token
  (recovered or bonus) and the next starts after it. This is what greedy speculative decoding
  does, up to rounding near ties. An undertrained target's greedy output repeats itself (runs
  of blank lines) and is easy to predict, so the usual teacher-forced estimate is reported too:
  the same walk over held-out text, where a draft token counts as accepted when the draft's
  argmax equals the target's given the true prefix;
- the cost of one decode step of each model at batch 1 with a 512-token context, through the
  engine's torch paged-attention backend.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from kv.cache import KVCache
from models.attention import TorchPagedAttention, paged_metadata
from models.llama import LlamaModel
from train import corpus, data
from train.bpe import load_tokenizer
from train.objectives import forward_logits

log = logging.getLogger("train")

DRAFT_LENGTHS = (2, 4, 6)
SEQ = 512


class DenseCacheAttention:
    """Causal attention with a growing dense KV cache, for a batch of left-padded rows.

    `valid` [B, L] marks the real (not padding) keys so far; `append` extends it before each
    forward of new tokens. A padding query also sees itself, so that no row is empty.
    """

    def __init__(self, valid: torch.Tensor):
        self.valid = valid  # [B, L] bool
        self.keys: dict[int, torch.Tensor] = {}  # layer -> [B, Hkv, L, D]
        self.values: dict[int, torch.Tensor] = {}

    def append(self, new_valid: torch.Tensor) -> None:
        self.valid = torch.cat([self.valid, new_valid], dim=1)

    def __call__(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor:
        b = self.valid.shape[0]
        t, hq, hkv, d = q.shape[0] // b, q.shape[1], k.shape[1], q.shape[2]
        qb = q.view(b, t, hq, d).transpose(1, 2)  # [B, Hq, t, D]
        kb = k.view(b, t, hkv, d).transpose(1, 2)  # [B, Hkv, t, D]
        vb = v.view(b, t, hkv, d).transpose(1, 2)
        if layer in self.keys:
            kb = torch.cat([self.keys[layer], kb], dim=2)
            vb = torch.cat([self.values[layer], vb], dim=2)
        self.keys[layer], self.values[layer] = kb, vb
        length = kb.shape[2]
        key_index = torch.arange(length)
        query_index = torch.arange(length - t, length)
        causal = key_index[None, :] <= query_index[:, None]  # [t, L]
        mask = (causal[None] & self.valid[:, None, :]) | (key_index == query_index[:, None])
        group = hq // hkv
        kb, vb = kb.repeat_interleave(group, dim=1), vb.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask[:, None])
        return out.transpose(1, 2).reshape(b * t, hq, d)


def left_pad(rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [B, L], positions [B, L] (0 on padding) and valid [B, L] for rows of token ids."""
    length = max(len(r) for r in rows)
    pad = torch.tensor([length - len(r) for r in rows])
    ids = torch.tensor([[0] * (length - len(r)) + r for r in rows])
    index = torch.arange(length)[None, :] - pad[:, None]
    return ids, index.clamp(min=0), index >= 0


@torch.no_grad()
def greedy_continue(model: LlamaModel, prompts: list[list[int]], new_tokens: int) -> torch.Tensor:
    """[B, new_tokens] greedy continuation of each prompt, batched with a KV cache."""
    ids, positions, valid = left_pad(prompts)
    b = ids.shape[0]
    attn = DenseCacheAttention(valid)
    hidden, _ = model(ids.reshape(-1), positions.reshape(-1), attn)
    token = model.logits(hidden.view(b, ids.shape[1], -1)[:, -1]).argmax(-1)  # [B]
    position = positions[:, -1]
    out = [token]
    for _ in range(new_tokens - 1):
        position = position + 1
        attn.append(torch.ones(b, 1, dtype=torch.bool))
        hidden, _ = model(token, position, attn)
        token = model.logits(hidden).argmax(-1)
        out.append(token)
    return torch.stack(out, dim=1)


@torch.no_grad()
def teacher_forced_argmax(model: LlamaModel, rows: list[list[int]]) -> torch.Tensor:
    """[B, L] argmax next token at every position of the left-padded rows."""
    ids, positions, valid = left_pad(rows)
    hidden, _ = model(ids.reshape(-1), positions.reshape(-1), DenseCacheAttention(valid))
    return model.logits(hidden).argmax(-1).view(ids.shape)


def acceptance(matches: list[list[bool]], k: int) -> float:
    """Tokens emitted per verify step of greedy chain drafting with k draft tokens.

    matches[r][i]: the draft's greedy token at continuation position i equals the target's.
    """
    tokens = steps = 0
    for row in matches:
        i = 0
        while i < len(row):
            accepted = 0
            while accepted < k and i + accepted < len(row) and row[i + accepted]:
                accepted += 1
            emitted = min(accepted + 1, len(row) - i)
            tokens, steps, i = tokens + emitted, steps + 1, i + emitted
    return tokens / steps


def simulate(
    target: LlamaModel, draft: LlamaModel, prompts: list[list[int]], new_tokens: int
) -> tuple[dict[int, float], float]:
    """Acceptance length per k, and the draft's greedy agreement on the continuations."""
    continuation = greedy_continue(target, prompts, new_tokens)  # [B, N]
    rows = [p + c.tolist() for p, c in zip(prompts, continuation, strict=True)]
    # in the left-padded layout every continuation ends the row; position -N-1 predicts token 0
    predicted = teacher_forced_argmax(draft, rows)[:, -new_tokens - 1 : -1]  # [B, N]
    matches = (predicted == continuation).tolist()
    agreement = (predicted == continuation).float().mean().item()
    return {k: acceptance(matches, k) for k in DRAFT_LENGTHS}, agreement


@torch.no_grad()
def heldout_stats(
    target: LlamaModel, draft: LlamaModel, windows: torch.Tensor, batch: int = 4
) -> tuple[dict[str, float], list[list[bool]]]:
    """Held-out losses of both models and their argmax agreement, over windows [N, S + 1];
    and per window and position whether the argmaxes agree [N][S]."""
    sums = {"target_loss": 0.0, "draft_loss": 0.0, "agreement": 0.0}
    matches: list[list[bool]] = []
    for chunk in windows.split(batch):
        labels = chunk[:, 1:].reshape(-1)
        t_logits = forward_logits(target, chunk[:, :-1])
        d_logits = forward_logits(draft, chunk[:, :-1])
        sums["target_loss"] += F.cross_entropy(t_logits, labels).item() * len(chunk)
        sums["draft_loss"] += F.cross_entropy(d_logits, labels).item() * len(chunk)
        same = t_logits.argmax(-1) == d_logits.argmax(-1)
        sums["agreement"] += same.float().mean().item() * len(chunk)
        matches += same.view(len(chunk), -1).tolist()
    return {name: value / len(windows) for name, value in sums.items()}, matches


@torch.no_grad()
def decode_step_ms(model: LlamaModel, context: int = SEQ, repeats: int = 30) -> float:
    """Median ms of one decode step (one token, `context` keys) at batch 1, lm_head included."""
    cfg = model.config
    page_size = 16
    pages = context // page_size
    cache = KVCache(cfg.num_layers, pages, page_size, cfg.num_kv_heads, cfg.head_dim)
    last = torch.tensor([context - 1])
    meta = paged_metadata(
        qo_indptr=torch.tensor([0, 1]),
        kv_indptr=torch.tensor([0, pages]),
        kv_indices=torch.arange(pages),
        kv_last_page_len=torch.tensor([page_size]),
        positions=last,
        slot_mapping=last,
        page_size=page_size,
        max_q=1,
        max_kv=context,
    )
    token = torch.tensor([1])
    times = []
    for _ in range(repeats + 3):
        started = time.perf_counter()
        attn = TorchPagedAttention(meta, cache, cfg.num_heads)
        hidden, _ = model(token, last, attn)
        model.logits(hidden).argmax(-1)
        times.append(time.perf_counter() - started)
    return statistics.median(times[3:]) * 1000


def prompt_ids(tokenizer_path: Path) -> list[list[int]]:
    tok = load_tokenizer(tokenizer_path)
    return [tok.encode(text).ids for text in corpus.load_prompts()]


def run(run_dir: Path, target_dir: Path, draft_dir: Path, windows: int, new_tokens: int) -> dict:
    """Evaluate the exported pair; prints a table and writes `run_dir/eval.json`."""
    from models.loader import load_model

    target = load_model(target_dir, dtype=torch.float32)
    draft = load_model(draft_dir, dtype=torch.float32)
    tok = load_tokenizer(target_dir / "tokenizer.json")
    heldout_texts = corpus.load_corpus().texts("heldout")
    tokens = data.tokenize_documents(tok, heldout_texts)
    stats, text_matches = heldout_stats(target, draft, data.fixed_windows(tokens, windows, SEQ))
    prompts = prompt_ids(target_dir / "tokenizer.json")
    accept, greedy_agreement = simulate(target, draft, prompts, new_tokens)
    target_ms, draft_ms = decode_step_ms(target), decode_step_ms(draft)
    result = {
        **stats,
        "greedy_agreement": greedy_agreement,
        "acceptance_length": {str(k): v for k, v in accept.items()},
        "acceptance_method": (
            f"exact greedy simulation: target greedy continuation of {new_tokens} tokens from "
            f"each of {len(prompts)} held-out prompts, draft teacher-forced over it"
        ),
        "acceptance_length_heldout_text": {
            str(k): acceptance(text_matches, k) for k in DRAFT_LENGTHS
        },
        "decode_step_ms": {
            "target": target_ms,
            "draft": draft_ms,
            "context": SEQ,
            "threads": torch.get_num_threads(),
        },
        "heldout_windows": min(windows, len(tokens) // SEQ),
    }
    (run_dir / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    print(format_table(result))
    return result


def format_table(r: dict) -> str:
    steps = r["decode_step_ms"]
    lines = [
        f"held-out loss     target {r['target_loss']:.3f}   draft {r['draft_loss']:.3f}",
        f"argmax agreement  held-out text {r['agreement']:.1%}   "
        f"target's greedy output {r['greedy_agreement']:.1%}",
        "acceptance length (tokens per verify step; " + r["acceptance_method"] + ")",
    ]
    text = r["acceptance_length_heldout_text"]
    lines += [
        f"  k={k}: {v:.2f}   (teacher-forced on held-out text: {text[k]:.2f})"
        for k, v in r["acceptance_length"].items()
    ]
    lines.append(
        f"decode step, batch 1, {steps['context']}-token context, {steps['threads']} threads: "
        f"target {steps['target']:.2f} ms, draft {steps['draft']:.2f} ms "
        f"(ratio {steps['target'] / steps['draft']:.1f}x)"
    )
    return "\n".join(lines)
