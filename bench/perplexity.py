"""Perplexity of held-out text through a GGUF file's quantized products, beside the same file
dequantized to float32 with a float32 KV cache.

    python -m bench.perplexity [--model smollm2|qwen2.5-coder|FILE.gguf] [--draft]
        [--paths vnni512 avx2] [--activations auto] [--kv float16 float32]
        [--context 512] [--tokens 3072]
        [--llama-perplexity BIN] [--out F.json]

Two texts: English, the Python reference's help topics (pydoc_data, shipped with the
interpreter and past the demo corpus's size limit), and code, the demo corpus's held-out
standard-library files (train/heldout_files.txt), each cut to `--tokens` tokens of the file's
vocabulary. Scored as llama.cpp's llama-perplexity scores: chunks of `--context` tokens, each
from an empty cache, the BOS first where the vocabulary asks for one, the second half of each
chunk's tokens scored (each predicted from every token before it in the chunk).

Variants: the weights at the file's types on each kernel path (`--paths`) with each choice of
the activations' quantization (`--activations`: models/native.py two_terms), or dequantized to
float32; each with each KV cache's dtype (`--kv`: the server's is float16 on the CPU). Every
kernel path reads the same packed weights, so the file is loaded once in float32 and once at
its types for each choice of the activations. With `--llama-perplexity`, llama.cpp's tool on
the same file and the same characters (2 threads).
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import tempfile
from pathlib import Path
from pydoc_data.topics import topics

import torch
import torch.nn.functional as F

from bench.common import paged_attention, text_table, write_json
from engine.builder import draft_model_path, model_path
from models import native
from models.llama import LlamaModel, prepare_for_inference
from models.loader import load_model
from models.tokenizer import Tokenizer
from train.corpus import HELDOUT_LIST, stdlib_root


def english(chars: int) -> str:
    """The help topics in order of their names, to `chars` characters."""
    return "\n\n".join(topics[k] for k in sorted(topics))[:chars]


def code(chars: int) -> str:
    """The held-out standard-library files in the list's order, to `chars` characters."""
    names = HELDOUT_LIST.read_text().split()
    root = stdlib_root()
    return "\n\n".join((root / n).read_text(encoding="utf-8") for n in names)[:chars]


def texts(tokenizer: Tokenizer, tokens: int) -> dict[str, tuple[str, list[int]]]:
    """Each text's characters and their first `tokens` ids (8 characters a token is ample)."""
    out = {}
    for name, text in (("English", english(8 * tokens)), ("code", code(8 * tokens))):
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < tokens:
            raise ValueError(f"the {name} text has {len(ids)} tokens, fewer than {tokens}")
        out[name] = (text, ids[:tokens])
    return out


def chunk_nll(model: LlamaModel, ids: list[int], kv: torch.dtype) -> tuple[float, int]:
    """The summed negative log-likelihood of a chunk's second half, and its token count."""
    q = len(ids)
    attn, positions = paged_attention(model.config, 1, 0, q, kv)
    hidden = model(torch.tensor(ids), positions, attn)[0]  # [q, H]
    first = q // 2
    logits = model.logits(hidden[first : q - 1]).float()  # [q - 1 - first, V]
    targets = torch.tensor(ids[first + 1 :])
    return F.cross_entropy(logits, targets, reduction="sum").item(), len(targets)


def perplexity(
    model: LlamaModel, ids: list[int], context: int, kv: torch.dtype, bos: int | None
) -> float:
    total, count = 0.0, 0
    for start in range(0, len(ids) - context + 1, context):
        chunk = ids[start : start + context]
        if bos is not None:
            chunk = [bos, *chunk[1:]]
        nll, n = chunk_nll(model, chunk, kv)
        total, count = total + nll, count + n
    return math.exp(total / count)


def load(path: Path, quantized: bool) -> LlamaModel:
    model = load_model(path, torch.float32, torch.device("cpu"), None, None, quantized)
    prepare_for_inference(model)
    return model


def ours(
    path: Path, args: argparse.Namespace, data: dict[str, list[int]], bos: int | None
) -> dict[str, dict[str, float]]:
    """{variant: {text: perplexity}}: float32 weights (the reference's KV float32 always), then
    each choice of the activations on each kernel path, each with each KV dtype."""
    result = {}

    def score(name: str, model: LlamaModel, kvs: list[str]) -> None:
        for kv in kvs:
            dtype = getattr(torch, kv)
            result[f"{name}, {kv} KV"] = {
                t: perplexity(model, ids, args.context, dtype, bos) for t, ids in data.items()
            }

    with torch.inference_mode():
        score("float32", load(path, quantized=False), sorted({"float32", *args.kv}))
        for activations in args.activations:
            os.environ[native.ACTIVATIONS_ENV] = activations
            model = load(path, quantized=True)
            for name in args.paths:
                os.environ[native.QUANT_PATH_ENV] = name
                native.quant_path()  # the kernels' path switched (the layout is shared)
                score(f"{name} {activations}", model, args.kv)
    return result


def llama_cpp(binary: Path, path: Path, text: str, context: int, chunks: int) -> float:
    """llama-perplexity's final estimate on `text` (2 threads)."""
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
        f.write(text)
        f.flush()
        sizes = ["-c", str(context), "-b", str(context), "--chunks", str(chunks)]
        args = [str(binary), "-m", str(path), "-f", f.name, *sizes, "-t", "2"]
        run = subprocess.run(args, capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+)", run.stdout + run.stderr)
    if found is None:
        raise RuntimeError(f"llama-perplexity gave no estimate: {run.stderr[-2000:]}")
    return float(found.group(1))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="smollm2, a pair's name, or a GGUF")
    parser.add_argument("--draft", action="store_true", help="the pair's draft model's file")
    parser.add_argument("--paths", nargs="+", default=["vnni512", "avx2"])
    parser.add_argument("--activations", nargs="+", default=["auto"], help="int8, int8x2, auto")
    parser.add_argument("--kv", nargs="+", default=["float16", "float32"])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=3072, help="of each text")
    parser.add_argument("--llama-perplexity", type=Path, help="llama.cpp's binary")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    torch.set_num_threads(2)
    path = draft_model_path(args.model) if args.draft else model_path(args.model)
    tokenizer = Tokenizer(path)
    cut = texts(tokenizer, args.tokens)
    bos = tokenizer.bos_token_id if tokenizer.adds_bos else None
    data = {name: ids for name, (_, ids) in cut.items()}
    result = ours(path, args, data, bos)
    if args.llama_perplexity:
        chunks = args.tokens // args.context
        result["llama.cpp"] = {
            name: llama_cpp(args.llama_perplexity, path, text, args.context, chunks)
            for name, (text, _) in cut.items()
        }
    reference = result["float32, float32 KV"]
    rows = [[variant] + [f"{v[t]:.4f} ({v[t] / reference[t]:.4f}x)" for t in data]
            for variant, v in result.items()]  # fmt: skip
    print(f"{path.name}: {args.tokens} tokens a text, chunks of {args.context}")
    print(text_table(["variant", *(f"{t} (x float32)" for t in data)], rows))
    if args.out:
        document = {"model": path.name, "tokens": args.tokens, "context": args.context}
        write_json(args.out, document | {"perplexity": result})


if __name__ == "__main__":
    main()
