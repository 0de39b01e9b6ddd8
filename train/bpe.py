"""Byte-level BPE for the demo models, trained with `tokenizers` on the corpus's training split.

One special token, `<|endoftext|>`, is bos, eos and the separator between documents. The chat
template renders each message as a `<|role|>` line followed by its content (the role markers
are ordinary text to this tokenizer; the demo models are not chat-tuned).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

EOS = "<|endoftext|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE: every byte is in the base alphabet, so no text is out of vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def tokenizer_config(max_length: int) -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOS,
        "eos_token": EOS,
        "pad_token": EOS,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok: Tokenizer, directory: Path, max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json into a model directory."""
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = tokenizer_config(max_length)
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def load_tokenizer(path: Path) -> Tokenizer:
    return Tokenizer.from_file(str(path))


def eos_id(tok: Tokenizer) -> int:
    token_id = tok.token_to_id(EOS)
    if token_id is None:
        raise ValueError(f"tokenizer has no {EOS}")
    return token_id
