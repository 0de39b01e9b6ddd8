"""tokenizer.json through `tokenizers`, chat templates, and streaming detokenization."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.gguf import is_gguf, tokenizer_from_gguf
from models.loader import CheckpointError

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete byte sequence
# prompt tokens decoded before the first output token, so that decoders that strip a leading
# space or merge across tokens see the context the output continues
PROMPT_CONTEXT = 5
# an incomplete UTF-8 character has at most 3 bytes, so at most 3 tokens hold it back
MAX_HELD_TOKENS = 4


class Tokenizer:
    """A Hugging Face tokenizer directory: tokenizer.json, and tokenizer_config.json if present.

    `encode(text)` adds the special tokens tokenizer.json's post-processor adds; when
    tokenizer_config.json sets `add_bos_token`, the BOS is then added (true) or removed
    (false) at the start so that the flag wins.
    """

    def __init__(self, directory: str | Path):
        """From a Hugging Face directory, or from a GGUF file's metadata (models/gguf.py)."""
        root = Path(directory)
        if is_gguf(root):
            for name, value in tokenizer_from_gguf(root).items():
                setattr(self, name, value)
            return
        if not (root / "tokenizer.json").is_file():
            raise CheckpointError(f"no tokenizer.json in {directory}")
        self.tokenizer = tokenizers.Tokenizer.from_file(str(root / "tokenizer.json"))
        config = _read_json(root / "tokenizer_config.json")
        self.bos_token: str | None = _token_text(config.get("bos_token"))
        self.eos_token: str | None = _token_text(config.get("eos_token"))
        self.add_bos_token: bool | None = config.get("add_bos_token")
        self.chat_template: str | None = _chat_template(root, config)

    @property
    def vocab_size(self) -> int:
        """Tokens the tokenizer knows, added tokens included (a model may pad its vocab)."""
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The longest token's spelling: no token stands for more characters of a text than
        this (a byte-level token's spelling has a character per byte; a fallback byte's, more
        characters than the byte), so a text of n characters encodes to at least n / this."""
        return max(len(token) for token in self.tokenizer.get_vocab(with_added_tokens=True))

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch lets go of the GIL while it works (encode holds it, seconds for a
        # megabyte), so that a server tokenizing on a worker thread keeps its loop running
        ids = self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if not add_special_tokens or bos is None or self.add_bos_token is None:
            return ids
        starts_with_bos = bool(ids) and ids[0] == bos
        if self.add_bos_token and not starts_with_bos:
            return [bos, *ids]
        if not self.add_bos_token and starts_with_bos:
            return ids[1:]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **extra: Any
    ) -> str:
        """The prompt text for a conversation.

        The template usually writes the BOS itself: encode the result with
        `add_special_tokens=False`.
        """
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        return _render(
            self.chat_template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **extra,
        )


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with open(path) as f:
        return json.load(f)


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    """A special token given as a string or as an AddedToken dict ({"content": ...})."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _chat_template(root: Path, config: dict[str, Any]) -> str | None:
    """tokenizer_config.json's chat_template (a string, or named templates), else
    chat_template.jinja (where transformers 5 writes it)."""
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {t["name"]: t["template"] for t in template}
        template = named.get("default")
    if template is None and (root / "chat_template.jinja").is_file():
        template = (root / "chat_template.jinja").read_text()
    return template


def _raise_exception(message: str) -> NoReturn:
    raise ValueError(f"chat template: {message}")


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, ensure_ascii=False, indent=indent)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _render(template: str, **context: Any) -> str:
    # the environment Hugging Face templates are written for: trimmed blocks, no autoescape
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(template).render(**context)


class IncrementalDetokenizer:
    """Turns a stream of output token ids into text deltas that are final.

    Only a window of recent tokens is decoded: `prefix_offset..read_offset` is text already
    returned (kept as context), `read_offset..` is not yet returned. A delta is never cut
    inside a UTF-8 character: while the window's text ends in U+FFFD (an incomplete byte
    sequence) those tokens are held back. The deltas, with `flush()` at the end, join to
    `tokenizer.decode(output_ids)` (for decoders that keep a leading space, such as
    byte-level BPE, and a prompt that ends on a whole character).
    """

    def __init__(
        self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special_tokens: bool = True
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_ids)
        self.read_offset = len(self.ids)
        self.prefix_offset = max(self.read_offset - PROMPT_CONTEXT, 0)
        self.prefix_text = self._decode(self.prefix_offset, self.read_offset)

    def add(self, token_ids: list[int]) -> str:
        """Text made final by these tokens (may be empty)."""
        self.ids.extend(token_ids)
        lowest = max(self.read_offset + 1, len(self.ids) - MAX_HELD_TOKENS + 1)
        for end in range(len(self.ids), lowest - 1, -1):
            text = self._decode(self.prefix_offset, end)
            if not text.endswith(REPLACEMENT):
                return self._advance(text, end)
        return ""

    def flush(self) -> str:
        """The rest, held-back bytes included (decoded as U+FFFD); call when the output ends."""
        if self.read_offset == len(self.ids):
            return ""
        return self._advance(self._decode(self.prefix_offset, len(self.ids)), len(self.ids))

    def _advance(self, text: str, end: int) -> str:
        """Return the text past the prefix and make tokens up to `end` the new prefix."""
        delta = text[len(self.prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)
