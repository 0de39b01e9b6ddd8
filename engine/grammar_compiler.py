"""Structured output's grammars: compiled by xgrammar for the served tokenizer, off the event
loop, with a time limit, and cached by what the request asked for.

xgrammar rather than llguidance (docs/performance.md compares them): its token masks are
cheaper, and the engine fills one a verified position and one a draft every step, while a
compile, dearer, is cached; it also gives the string a grammar forces next, which host drafts
spell.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xgrammar as xgr

from core.params import Grammar, InvalidRequest
from models.tokenizer import Tokenizer

COMPILE_TIMEOUT_S = 10.0  # past it a request's grammar is refused (a 400)
CACHED_GRAMMARS = 256  # compiled grammars kept, least recently used dropped first


class Grammars:
    """The served model's grammar compiler and its cache of compiled grammars."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, timeout_s: float = COMPILE_TIMEOUT_S):
        specials = tokenizer.special_ids
        # special tokens spell nothing: the grammar never allows one, eos aside (its end)
        # a model's vocabulary may be padded past the tokenizer's, or cut below it
        known = min(tokenizer.vocab_size, vocab_size)
        vocab = [b"" if i in specials else tokenizer.token_bytes(i) for i in range(known)]
        eos = tokenizer.eos_token_id
        stops = [eos] if eos is not None else None
        raw = xgr.VocabType.RAW
        info = xgr.TokenizerInfo(vocab, raw, vocab_size=vocab_size, stop_token_ids=stops)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.timeout_s = timeout_s
        self.vocab_size = vocab_size
        self.eos = eos
        self._compiled: OrderedDict[Grammar, Any] = OrderedDict()
        # compiles run here; a compile past its time limit keeps its thread until it ends
        self._pool = ThreadPoolExecutor(2, thread_name_prefix="grammar")

    async def compile(self, grammar: Grammar) -> None:
        """Compile (or find cached) on a worker thread; InvalidRequest when the grammar is
        invalid, unsupported, or takes longer than the time limit."""
        if grammar in self._compiled:
            self._compiled.move_to_end(grammar)
            return
        work = asyncio.get_running_loop().run_in_executor(self._pool, self._compile, grammar)
        try:
            compiled = await asyncio.wait_for(work, self.timeout_s)
        except TimeoutError:
            raise InvalidRequest(
                f"the {grammar.kind} grammar took longer than {self.timeout_s:g} s to compile"
            ) from None
        self._compiled[grammar] = compiled
        while len(self._compiled) > CACHED_GRAMMARS:
            self._compiled.popitem(last=False)

    def matcher(self, grammar: Grammar) -> RequestMatcher:
        """A fresh matcher of a compiled grammar (`compile` first: never on the event loop)."""
        compiled = self._compiled.get(grammar)
        if compiled is None:
            raise InvalidRequest("the request's grammar is not compiled: await compile() first")
        return RequestMatcher(compiled)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, grammar: Grammar) -> Any:
        try:
            compiled = _COMPILE[grammar.kind](self.compiler, grammar.source)
        except (RuntimeError, ValueError, TypeError) as e:  # xgrammar's errors on bad input
            raise InvalidRequest(f"invalid {grammar.kind}: {_first_line(e)}") from None
        if _matches_nothing(compiled):
            raise InvalidRequest(
                f"the {grammar.kind} matches nothing: no text the model's vocabulary can "
                "spell starts it"
            )
        return compiled


def _matches_nothing(compiled: xgr.CompiledGrammar) -> bool:
    """Whether the grammar allows no first token and is not complete empty (an empty
    language, or one the vocabulary cannot spell: proven before any token is generated)."""
    matcher = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(mask)
    return not bool(mask.any()) and not matcher.is_terminated()


class RequestMatcher(xgr.GrammarMatcher):
    """A request's matcher (core.request.Matcher), which knows its masks' width."""

    def __init__(self, compiled: xgr.CompiledGrammar):
        super().__init__(compiled)
        self.vocab_size = compiled.tokenizer_info.vocab_size


# A JSON string's characters, as xgrammar writes them: any but these four in a length-bounded
# string (raw control characters pass, which JSON wants escaped), and in others any but control
# characters, quote, backslash; both take UTF-16 surrogates (U+D800-DFFF), whose UTF-8 bytes are
# no valid text. Both become JSON's characters.
_STRING_CHARACTERS = (r"[^\"\\\r\n]", r"[^\0-\x1f\"\\\r\n]")
_JSON_CHARACTER = r"[^\0-\x1f\"\\\r\n\ud800-\udfff]"


def _json_schema(compiler: xgr.GrammarCompiler, source: str) -> Any:
    # no free whitespace between JSON tokens, so that a small model cannot wander in spaces
    ebnf = str(xgr.Grammar.from_json_schema(source, any_whitespace=False, strict_mode=True))
    for lax in _STRING_CHARACTERS:
        ebnf = ebnf.replace(lax, _JSON_CHARACTER)
    return compiler.compile_grammar(ebnf)


def _choice(compiler: xgr.GrammarCompiler, source: str) -> Any:
    choices = json.loads(source)
    # JSON's string escapes are EBNF's: each choice is a literal
    alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
    return compiler.compile_grammar(f"root ::= {alternatives}")


_COMPILE = {
    "json_schema": _json_schema,
    "json_object": lambda c, _: _json_schema(c, '{"type": "object"}'),
    "regex": lambda c, source: c.compile_regex(source),
    "choice": _choice,
    "ebnf": lambda c, source: c.compile_grammar(source),
}


# xgrammar's messages begin with a time, a source location and its check's own wording
_LOG_PREFIX = re.compile(r"^(\[[\d:]+\] \S+:\d+: )?(Check failed: .*? is false: )?")


def _first_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    text = _LOG_PREFIX.sub("", lines[0]) if lines else type(error).__name__
    return text[:300]
