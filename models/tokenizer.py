"""tokenizer.json through `tokenizers`, chat templates, and streaming detokenization."""

from __future__ import annotations

import codecs
import functools
import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import tokenizers
from jinja2.sandbox import ImmutableSandboxedEnvironment

from models.checkpoint import CheckpointError
from models.gguf import is_gguf
from models.gguf_tokenizer import tokenizer_from_gguf

REPLACEMENT = "\ufffd"  # what a lossy UTF-8 decode yields for an incomplete byte sequence
# prompt tokens decoded before the first output token, so that decoders that strip a leading
# space or merge across tokens see the context the output continues
PROMPT_CONTEXT = 5
# an incomplete UTF-8 character has at most 3 bytes, so at most 3 tokens hold it back
MAX_HELD_TOKENS = 4


# fill-in-the-middle markers, prefix, suffix, middle: Qwen2.5-Coder's, then StarCoder's
FIM_SPELLINGS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
)


# a repository's name and a file's start, around the other files of a fill in the middle
# (llama.cpp's FIM_REP and FIM_SEP, found by these spellings)
FIM_REPO = ("<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
FIM_FILE = ("<|file_separator|>", "<|file_sep|>", "<file_sep>")

FIM_STOPS = ("<|endoftext|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>")


class Tokenizer:
    """A Hugging Face tokenizer directory: tokenizer.json, and tokenizer_config.json if present.

    What the user wrote is never changed. `encode(text)` parses special-token spellings (a
    raw prompt may spell out a chat format) and puts the model's BOS first where its metadata
    asks for one (`add_bos_token`, else tokenizer.json's post-processor) and the text does not
    already begin with it; nothing else is added or removed. `encode_chat(messages)` renders
    the chat template and parses the special tokens the template writes, while a message's
    content is text: a special-token spelling inside it is tokenized as the characters it is
    (so that no user can end a turn or open another role by typing its marker).
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

    @functools.cached_property
    def adds_bos(self) -> bool:
        """Whether a prompt starts with the BOS: tokenizer_config.json's add_bos_token, else
        what tokenizer.json's post-processor does."""
        if self.bos_token_id is None:
            return False
        if self.add_bos_token is not None:
            return self.add_bos_token
        return self.tokenizer.encode("", add_special_tokens=True).ids[:1] == [self.bos_token_id]

    @functools.cached_property
    def specials(self) -> dict[str, int]:
        """Special tokens by spelling (added tokens flagged special: control markers)."""
        added = self.tokenizer.get_added_tokens_decoder()
        return {token.content: i for i, token in added.items() if token.special}

    @functools.cached_property
    def special_ids(self) -> frozenset[int]:
        return frozenset(self.specials.values())

    @functools.cached_property
    def _literal(self) -> tokenizers.Tokenizer:
        """The same tokenizer with special-token spellings read as plain text."""
        literal = tokenizers.Tokenizer.from_str(self.tokenizer.to_str())
        literal.encode_special_tokens = True
        return literal

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether tokens spell bytes through GPT-2's byte-to-character table."""
        return '"ByteLevel"' in json.dumps(json.loads(self.tokenizer.to_str()).get("decoder"))

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

    @functools.cached_property
    def fim_ids(self) -> tuple[int, int, int] | None:
        """The fill-in-the-middle markers (prefix, suffix, middle) where the vocabulary has
        them as special tokens: Qwen2.5-Coder's and StarCoder's spellings."""
        for spellings in FIM_SPELLINGS:
            ids = [self.specials.get(s) for s in spellings]
            if all(i is not None for i in ids):
                return ids[0], ids[1], ids[2]  # type: ignore[return-value]
        return None

    def encode_fill(self, prefix: str, suffix: str) -> list[int]:
        """A fill in the middle's prompt: <prefix marker> prefix <suffix marker> suffix
        <middle marker>, as the model was trained to fill; the model must have the markers."""
        assert self.fim_ids is not None, "this vocabulary has no fill-in-the-middle tokens"
        start, middle, end = self.fim_ids
        head = self.encode(prefix, add_special_tokens=False)
        tail = self.encode(suffix, add_special_tokens=False)
        return [start, *head, middle, *tail, end]

    @functools.cached_property
    def fim_repo_ids(self) -> tuple[int | None, int | None]:
        """The repository-name and file-separator markers, each None where the vocabulary
        has no such special token."""
        repo = next((self.specials[s] for s in FIM_REPO if s in self.specials), None)
        file = next((self.specials[s] for s in FIM_FILE if s in self.specials), None)
        return repo, file

    def encode_text(self, text: str) -> list[int]:
        """The text's ids with special-token spellings as the characters they are (code an
        editor sends is text)."""
        return _encode(self._literal, text)

    @functools.cached_property
    def fim_stop_ids(self) -> tuple[int, ...]:
        """The special tokens that end a fill in the middle besides eos (llama.cpp's
        end-of-generation set for these vocabularies)."""
        return tuple(i for s in FIM_STOPS if (i := self.specials.get(s)) is not None)

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """The text's ids, special-token spellings parsed; with `add_special_tokens`, the
        model's BOS first where it asks for one and the text does not begin with it."""
        ids = _encode(self.tokenizer, text)
        bos = self.bos_token_id
        if add_special_tokens and self.adds_bos and ids[:1] != [bos]:
            return [bos, *ids]  # type: ignore[list-item]
        return ids

    def encode_chat(self, messages: list[dict[str, Any]], **extra: Any) -> list[int]:
        """A conversation's prompt ids: the template's special tokens parsed, the content's
        special-token spellings kept as text (the template writes the BOS where it wants
        one)."""
        spelled = self._special_pattern
        if spelled is None or not any(_spells(m, spelled) for m in messages):
            return self.encode(self.apply_chat_template(messages, **extra), False)
        # each spelling's first character is masked while the template renders, so that only
        # the template's own markers are parsed, then restored in the text between them
        masks = _masks(messages, {s[0] for s in self.specials})
        hidden = [_mask(m, spelled, masks) for m in messages]
        text = self.apply_chat_template(hidden, **extra)
        unmask = str.maketrans({mask: char for char, mask in masks.items()})
        ids: list[int] = []
        for i, piece in enumerate(spelled.split(text)):
            if i % 2:  # a marker the template wrote
                ids.append(self.specials[piece])
            elif piece:
                ids.extend(_encode(self._literal, piece.translate(unmask)))
        return ids

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        names = sorted(self.specials, key=len, reverse=True)
        return re.compile("(" + "|".join(map(re.escape, names)) + ")") if names else None

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes a token stands for (a piece of a character for some: decoding it alone
        would give U+FFFD)."""
        return _token_bytes(self.tokenizer, self._byte_level, token_id)

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


def _encode(tokenizer: tokenizers.Tokenizer, text: str) -> list[int]:
    # encode_batch lets go of the GIL while it works (encode holds it, seconds for a
    # megabyte), so that a server tokenizing on a worker thread keeps its loop running
    return tokenizer.encode_batch([text], add_special_tokens=False)[0].ids


def _spells(message: dict[str, Any], pattern: re.Pattern[str]) -> bool:
    content = message.get("content")
    return isinstance(content, str) and pattern.search(content) is not None


def _masks(messages: list[dict[str, Any]], chars: set[str]) -> dict[str, str]:
    """A private-use character for each of `chars`, none of which the messages hold."""
    used = set().union(*(set(str(m.get("content") or "")) for m in messages))
    free = (chr(c) for c in range(0xE000, 0xF900) if chr(c) not in used)
    return {char: next(free) for char in sorted(chars)}


def _mask(message: dict[str, Any], pattern: re.Pattern[str], masks: dict[str, str]) -> dict:
    if not _spells(message, pattern):
        return message
    hide = lambda m: masks[m.group()[0]] + m.group()[1:]  # noqa: E731
    return message | {"content": pattern.sub(hide, message["content"])}


# GPT-2's table: each byte is spelled by one printable character in byte-level vocabularies
_BYTE_CHARS = [
    *range(ord("!"), ord("~") + 1),
    *range(ord("\xa1"), ord("\xac") + 1),
    *range(ord("\xae"), ord("\xff") + 1),
]
BYTE_OF_CHAR = {
    chr(c): b
    for b, c in zip(
        [*_BYTE_CHARS, *(b for b in range(256) if b not in _BYTE_CHARS)],
        [*_BYTE_CHARS, *range(256, 256 + 256 - len(_BYTE_CHARS))],
        strict=True,
    )
}
BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's spelling of a raw byte


@functools.lru_cache(maxsize=1 << 16)
def _token_bytes(tokenizer: tokenizers.Tokenizer, byte_level: bool, token_id: int) -> bytes:
    token = tokenizer.id_to_token(token_id) or ""
    if token_id in tokenizer.get_added_tokens_decoder():
        return token.encode()
    if byte_level and all(c in BYTE_OF_CHAR for c in token):
        return bytes(BYTE_OF_CHAR[c] for c in token)
    if match := BYTE_FALLBACK.fullmatch(token):
        return bytes([int(match.group(1), 16)])
    return token.replace("\u2581", " ").encode()  # SentencePiece spells a space as U+2581


def incomplete_tail(data: bytes) -> int:
    """Bytes at the end of `data` that begin a UTF-8 character and do not finish it."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(data, final=False)
    return len(decoder.getstate()[0])


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
    `tokenizer.decode(output_ids)` less the bytes of a last character the output did not
    finish (for decoders that keep a leading space, such as byte-level BPE, and a prompt that
    ends on a whole character).
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
        """The rest; call when the output ends. The bytes of a character the output did not
        finish are dropped (they would decode as U+FFFD); a U+FFFD the bytes spell stays."""
        if self.read_offset == len(self.ids):
            return ""
        text = self._decode(self.prefix_offset, len(self.ids))
        held = self.ids[self.read_offset :]
        if self.skip_special_tokens:
            held = [t for t in held if t not in self.tokenizer.special_ids]
        if incomplete_tail(b"".join(map(self.tokenizer.token_bytes, held))):
            text = text.removesuffix(REPLACEMENT)
        return self._advance(text, len(self.ids))

    def _advance(self, text: str, end: int) -> str:
        """Return the text past the prefix and make tokens up to `end` the new prefix."""
        delta = text[len(self.prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, end
        self.prefix_text = self._decode(self.prefix_offset, self.read_offset)
        return delta

    def _decode(self, start: int, end: int) -> str:
        return self.tokenizer.decode(self.ids[start:end], self.skip_special_tokens)
