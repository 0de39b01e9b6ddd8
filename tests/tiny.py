"""Tiny checkpoints for tests: random Llama weights with wide top-2 logit gaps, and a small
byte-level BPE tokenizer, written as Hugging Face directories."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.checkpoint import read_config, read_safetensors
from models.eagle import Eagle3Head, EagleHead, save_eagle_head
from models.gguf import LAYER_NAMES, TOP_NAMES
from models.llama import LlamaConfig, LlamaModel
from models.loader import load_model, save_pretrained
from models.mtp import MTPHead, save_mtp_head

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "for i in range(10):\n    print(i, 'héllo wörld')\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n        self.y = y\n",
    "日本語のテキスト 🙂 and some English text about tokens.",
] * 20

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]  # Qwen2.5-Coder's markers
REPO = ["<|repo_name|>", "<|file_sep|>"]  # ... and its repository-level ones


def write_tokenizer(directory: Path, vocab_size: int = 320, repo: bool = False) -> int:
    """A byte-level BPE tokenizer trained on TEXT, with fill-in-the-middle markers (and the
    repository-level ones where `repo`: /infill's prompt has them); returns its vocabulary
    size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", *FIM, *(REPO if repo else [])],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(TEXT, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {
        "bos_token": "<|endoftext|>",
        "eos_token": "<|endoftext|>",
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size()


def write_model(
    directory: Path,
    layers: int = 2,
    hidden: int = 64,
    seed: int = 0,
    scale: float = 0.5,
    vocab_size: int = 320,
    max_len: int = 512,
    model_vocab: int | None = None,
    head_dim: int = 16,
    **config: Any,
) -> Path:
    """A random model with a large init scale, so that top-2 logit gaps are wide and greedy
    decoding does not depend on rounding; plus the tokenizer. FlashInfer runs head_dim 64.
    `config`: more LlamaConfig fields (a Qwen2's architecture and biases, tied embeddings)."""
    vocab = model_vocab or write_tokenizer(directory, vocab_size)
    if model_vocab:
        write_tokenizer(directory, vocab_size)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=max(2, hidden // head_dim),
        num_kv_heads=max(1, hidden // head_dim // 2),
        head_dim=head_dim,
        max_position_embeddings=max_len,
        eos_token_id=0,
        bos_token_id=0,
        **config,
    )
    model = LlamaModel(cfg)
    randomize(model, seed, scale)
    save_pretrained(model, directory, dtype=torch.float32)
    return directory


def random_eagle_head(
    target: LlamaModel, norms: bool, seed: int = 3, scale: float = 0.5
) -> EagleHead:
    """A head of the target's shapes with large random weights (wide top-2 logit gaps)."""
    head = EagleHead(target.config, target, norms=norms, fc_bias=not norms)
    randomize(head, seed, scale)
    return head.eval().requires_grad_(False)


def random_eagle3_head(
    target: LlamaModel, aux_layers: tuple[int, ...], draft_vocab: int, seed: int = 4
) -> Eagle3Head:
    """An EAGLE-3 head with large random weights over a random draft vocabulary."""
    cfg = dataclasses.replace(target.config, num_layers=1)
    head = Eagle3Head(cfg, target, aux_layers, draft_vocab)
    randomize(head, seed, 0.5)
    vocab = target.config.vocab_size
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    head.set_draft_vocab(order[:draft_vocab])
    return head.eval().requires_grad_(False)


def random_mtp_head(target: LlamaModel, seed: int = 0, scale: float = 0.5) -> MTPHead:
    """An MTP head of the target's shapes with large random weights: a Llama block (no
    q/k/v biases, whatever the target's)."""
    cfg = dataclasses.replace(target.config, num_layers=1, attention_bias=False)
    head = MTPHead(cfg, target)
    randomize(head, seed, scale)
    return head.eval().requires_grad_(False)


def randomize(module: torch.nn.Module, seed: int, scale: float) -> None:
    """Every weight but the norms' drawn at `scale` (large: wide top-2 logit gaps)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale / p.shape[-1] ** 0.5)


def write_near_tie_model(directory: Path, seed: int = 0, gap: float = 1e-6) -> Path:
    """A random model whose tokens come in pairs with almost the same lm_head row (relative
    difference `gap`): at nearly every step the top two logits lie within rounding of each
    other, so that a forward that rounds differently (a verify of k + 1 rows against a
    one-row decode) picks the other token of the pair."""
    write_model(directory, seed=seed)
    model = load_model(directory)
    weight = model.lm_head.weight
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        twin = weight[0::2][: weight[1::2].shape[0]]
        noise = torch.randn(twin.shape, generator=generator)
        weight[1::2] = twin * (1 + gap * noise)
    save_pretrained(model, directory, dtype=torch.float32)
    return directory


# ---------------------------------------------------------------- GGUF files

Q8_0 = gguf.GGMLQuantizationType.Q8_0
# a file of every type with codes that a 64-wide model can hold (Q4_K needs 256 inputs)
T = gguf.GGMLQuantizationType
QUANT_MIX = {
    "attn_q": T.Q4_0,
    "attn_k": T.Q4_0,
    "attn_v": T.Q5_0,
    "attn_output": T.Q4_1,
    "ffn_gate": T.Q4_1,
    "ffn_up": T.Q4_1,
    "ffn_down": T.Q8_0,
    "token_embd": T.Q8_0,
    "output": T.Q4_0,
}
SPECIAL = 3  # llama.cpp's token type of a control token


def permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's reordering of q/k rows for its rotary layout."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_name(hf: str) -> str:
    ours = hf.removeprefix("model.")
    if ours.startswith("layers."):
        _, layer, *module, kind = ours.split(".")
        short = {v: k for k, v in LAYER_NAMES.items()}[".".join(module)]
        return f"blk.{layer}.{short}.{kind}"
    module, kind = ours.split(".")
    return f"{ {v: k for k, v in TOP_NAMES.items()}[module] }.{kind}"


def write_gguf(
    directory: Path,
    path: Path,
    kinds: gguf.GGMLQuantizationType | dict[str, gguf.GGMLQuantizationType] | None = None,
    **overrides,
) -> Path:
    """The HF checkpoint in `directory` as a GGUF file at `path`; `kinds`: the type of every
    matrix, or by GGUF tensor kind ("attn_q", "token_embd", ...) or name ("blk.0.attn_q"),
    the others F32."""
    cfg = read_config(directory) | overrides
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    writer = gguf.GGUFWriter(str(path), cfg.get("gguf_arch", "llama"))
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    writer.add_vocab_size(cfg["vocab_size"])
    write_vocab(writer, directory, cfg.get("gguf_pre", "gpt2"))
    for name, tensor in read_safetensors(directory).items():
        w = tensor.float().numpy()
        llama = cfg.get("gguf_arch", "llama") == "llama"  # llama.cpp permutes a Llama's q, k
        if llama and name.endswith("q_proj.weight"):
            w = permute(w, heads)
        elif llama and name.endswith("k_proj.weight"):
            w = permute(w, kv_heads)
        full = gguf_name(name).removesuffix(".weight")
        kind = kinds.get(full, kinds.get(full.split(".")[-1])) if isinstance(kinds, dict) else kinds
        if kind is not None and w.ndim == 2:
            writer.add_tensor(gguf_name(name), quantized(w, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gguf_name(name), w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# where a type's float16 scales sit in its block (the first two bytes but for these)
SCALE_BYTES = {gguf.GGMLQuantizationType.Q4_K: (0, 4), gguf.GGMLQuantizationType.Q6_K: (208, 210)}


def quantized(w: np.ndarray, kind: gguf.GGMLQuantizationType) -> np.ndarray:
    """w's blocks of `kind`: quantized by the gguf library where it can, else random bytes
    whose float16 scales are 0.01."""
    try:
        return gguf.quants.quantize(w, kind)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[kind]
        rng = np.random.default_rng(0)
        data = rng.integers(0, 256, (w.shape[0], w.shape[1] // block, size), dtype=np.uint8)
        start, end = SCALE_BYTES.get(kind, (0, 2))
        data[..., start:end] = np.full((end - start) // 2, 0.01, np.float16).view(np.uint8)
        return data.reshape(w.shape[0], -1)


def write_vocab(writer: gguf.GGUFWriter, directory: Path, pre: str) -> None:
    spec = json.loads((directory / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    special = {a["content"] for a in spec["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([SPECIAL if t in special else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(vocab["<|endoftext|>"])
    writer.add_eos_token_id(vocab["<|endoftext|>"])
    writer.add_add_bos_token(False)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    writer.add_chat_template(config["chat_template"])


QWEN2 = {"attention_bias": True, "rope_theta": 1e6, "architecture": "Qwen2ForCausalLM"}
# the Qwen2.5-Coder 1.5B file's types (tied embeddings) and the 0.5B's (an output matrix of its
# own)
QWEN2_TARGET_TYPES = {
    **{k: T.Q4_K for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up")},
    **{k: T.Q6_K for k in ("attn_v", "ffn_down", "token_embd")},
}
QWEN2_DRAFT_TYPES = {
    **{k: T.Q5_0 for k in ("attn_q", "attn_k", "attn_output", "ffn_gate", "ffn_up", "token_embd")},
    **{k: T.Q8_0 for k in ("attn_v", "ffn_down", "output")},
}


def write_qwen2_pair(root: Path) -> dict[str, Path]:
    """The Qwen2.5-Coder pair, small: a random 256-wide qwen2 target and draft (K types need
    256 inputs) as GGUF files of the real files' types, and random EAGLE and MTP heads of the
    target; by name: target, draft, eagle, mtp."""
    files = {}
    for name, types, tied in (
        ("target", QWEN2_TARGET_TYPES, True),
        ("draft", QWEN2_DRAFT_TYPES, False),
    ):
        source = write_model(
            root / name, 2, 256, len(files), head_dim=64, tie_word_embeddings=tied, **QWEN2
        )
        files[name] = write_gguf(
            source, root / f"{name}.gguf", types, gguf_arch="qwen2", gguf_pre="qwen2"
        )
    target = load_model(files["target"])
    save_eagle_head(random_eagle_head(target, norms=False), root / "eagle")
    save_mtp_head(random_mtp_head(target, seed=7), root / "mtp")
    return files | {"eagle": root / "eagle", "mtp": root / "mtp"}
