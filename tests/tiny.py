"""Tiny checkpoints for tests: random Llama weights with wide top-2 logit gaps, and a small
byte-level BPE tokenizer, written as Hugging Face directories."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from models.eagle import Eagle3Head, EagleHead
from models.llama import LlamaConfig, LlamaModel
from models.loader import load_model, save_pretrained
from models.mtp import MTPHead

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
    head_dim: int = 16,
) -> Path:
    """A random model with a large init scale, so that top-2 logit gaps are wide and greedy
    decoding does not depend on rounding; plus the tokenizer. FlashInfer runs head_dim 64."""
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
    """An MTP head of the target's shapes with large random weights."""
    cfg = dataclasses.replace(target.config, num_layers=1)
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
