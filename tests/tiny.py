"""Tiny checkpoints for tests: random Llama weights with wide top-2 logit gaps, and a small
byte-level BPE tokenizer, written as Hugging Face directories."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.llama import LlamaConfig, LlamaModel
from models.loader import save_pretrained

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


def write_tokenizer(directory: Path, vocab_size: int = 320) -> int:
    """A byte-level BPE tokenizer trained on TEXT; returns its vocabulary size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
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
) -> Path:
    """A random model with a large init scale, so that top-2 logit gaps are wide and greedy
    decoding does not depend on rounding; plus the tokenizer."""
    vocab = model_vocab or write_tokenizer(directory, vocab_size)
    if model_vocab:
        write_tokenizer(directory, vocab_size)
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_layers=layers,
        num_heads=max(2, hidden // 16),
        num_kv_heads=max(1, hidden // 32),
        max_position_embeddings=max_len,
        eos_token_id=0,
        bos_token_id=0,
    )
    generator = torch.Generator().manual_seed(seed)
    model = LlamaModel(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=generator) * scale / p.shape[-1] ** 0.5)
    save_pretrained(model, directory, dtype=torch.float32)
    return directory
