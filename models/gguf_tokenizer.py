"""A GGUF file's tokenizer, rebuilt with `tokenizers` from its metadata: the tokens, merges
and token types, the pre-tokenizer `tokenizer.ggml.pre` names (as llama.cpp splits text before
BPE), the chat template and the bos/eos ids. Anything else is refused by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, pre_tokenizers
from tokenizers.models import BPE

from models.checkpoint import CheckpointError
from models.gguf import metadata

# GPT-2's split, which ByteLevel(use_regex=True) applies itself
GPT2 = "gpt2"
LLAMA3_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")  # digits one at a time
# tokenizer.ggml.pre -> how llama.cpp splits text before BPE (its llama-vocab.cpp)
PRE_TOKENIZERS = {
    "gpt2": GPT2,
    "gpt-2": GPT2,
    "smollm": "digits+gpt2",  # each digit alone, then GPT-2's split
    "starcoder": "digits+gpt2",
    "refact": "digits+gpt2",
    "llama-bpe": "llama3",
    "llama3": "llama3",
    "qwen2": "qwen2",
}
TOKEN_CONTROL, TOKEN_USER_DEFINED = 3, 4  # llama.cpp's token types: special, added


def tokenizer_from_gguf(path: str | Path) -> dict[str, Any]:
    """The pieces of models.tokenizer.Tokenizer from a GGUF's metadata: `tokenizer` (a
    tokenizers.Tokenizer), `bos_token`, `eos_token`, `add_bos_token`, `chat_template`."""
    meta = metadata(path)
    kind = meta.get("tokenizer.ggml.model")
    if kind != "gpt2":
        raise CheckpointError(f"GGUF tokenizer {kind!r} is not supported (only BPE, 'gpt2')")
    pre = meta.get("tokenizer.ggml.pre", "default")  # llama.cpp's name when unset
    if pre not in PRE_TOKENIZERS:
        raise CheckpointError(f"GGUF pre-tokenizer {pre!r} is not supported")
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = tokenizers.Tokenizer(BPE(vocab, merges, ignore_merges=False))
    tok.pre_tokenizer = _pre_tokenizer(PRE_TOKENIZERS[pre])
    tok.decoder = decoders.ByteLevel()
    added = [
        tokenizers.AddedToken(t, special=token_type == TOKEN_CONTROL, normalized=False)
        for t, token_type in zip(tokens, types, strict=True)
        if token_type in (TOKEN_CONTROL, TOKEN_USER_DEFINED)
    ]
    tok.add_special_tokens([a for a in added if a.special])
    tok.add_tokens([a for a in added if not a.special])
    token = lambda key: None if (i := meta.get(key)) is None else tokens[i]  # noqa: E731
    return {
        "tokenizer": tok,
        "bos_token": token("tokenizer.ggml.bos_token_id"),
        "eos_token": token("tokenizer.ggml.eos_token_id"),
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token"),
        "chat_template": meta.get("tokenizer.chat_template"),
    }


SPLITS = {"llama3": LLAMA3_REGEX, "qwen2": QWEN2_REGEX}  # a regex of their own, then bytes


def _pre_tokenizer(kind: str) -> pre_tokenizers.PreTokenizer:
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=kind not in SPLITS)
    if kind == "digits+gpt2":
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if kind in SPLITS:
        split = pre_tokenizers.Split(tokenizers.Regex(SPLITS[kind]), behavior="isolated")
        return pre_tokenizers.Sequence([split, byte_level])
    return byte_level
