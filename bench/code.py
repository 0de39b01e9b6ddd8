"""Code workloads, fixed by this file (Python's own library is the code): what a code model's
users send it. bench.peer sends them to both servers (`--workload complete|code-chat|edits`).

- complete: fill in the middle. A function of the library to be written from its signature
  and docstring, the module's code before it as the prefix and after it as the suffix (up to
  CONTEXT_CHARS each side).
- edits: a function of 49-102 lines to be answered whole, changed: a variable renamed, a
  parameter added, or a misspelt name on one line fixed, the three in turn.
- code-chat: requests to write a function or explain a snippet.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

CONTEXT_CHARS = 1500
EDITS = (  # (module, function, a variable in it, its new name)
    ("textwrap", "dedent", "margin", "common_margin"),
    ("heapq", "nsmallest", "result", "found"),
    ("heapq", "merge", "h_append", "push"),
    ("json.decoder", "JSONObject", "pairs", "members"),
    ("fractions", "Fraction.limit_denominator", "bound1", "lower"),
    ("textwrap", "TextWrapper._wrap_chunks", "cur_line", "line"),
)
COMPLETIONS = (  # (module, function)
    ("textwrap", "indent"),
    ("shlex", "quote"),
    ("heapq", "nlargest"),
    ("textwrap", "shorten"),
    ("fractions", "Fraction.as_integer_ratio"),
    ("json.encoder", "py_encode_basestring"),
)
CHATS = (
    "Write a Python function that parses a duration such as '1h30m' or '45s' into seconds, "
    "with type hints and a docstring.",
    "Write a Python class implementing an LRU cache with get and put, without functools.",
    "Explain what this does and when it fails:\n\n```python\n"
    "def chunks(xs, n):\n    return [xs[i:i + n] for i in range(0, len(xs), n)]\n```",
    "Write a function that merges two sorted lists of integers into one sorted list, in "
    "linear time, and a few pytest tests for it.",
    "Rewrite this loop as a dict comprehension and explain the difference:\n\n```python\n"
    "out = {}\nfor k, v in pairs:\n    if v is not None:\n        out[k] = v * 2\n```",
    "Write a Python function that reads a CSV file and returns the mean of each numeric "
    "column, using only the standard library.",
)


@dataclass(frozen=True)
class Fill:
    """A fill in the middle: the code before the hole and after it."""

    prefix: str
    suffix: str


def _function(module: str, name: str) -> tuple[str, Any]:
    target: Any = importlib.import_module(module)
    for part in name.split("."):
        target = getattr(target, part)
    return inspect.getsource(importlib.import_module(module)), target


def completions() -> list[Fill]:
    """Each function's signature and docstring, the module around it; the body the hole."""
    fills = []
    for module, name in COMPLETIONS:
        source, function = _function(module, name)
        body = inspect.getsource(function)
        start = source.index(body)
        doc = inspect.getdoc(function)
        assert doc, name
        head_end = body.index('"""', body.index('"""') + 3) + 3  # the docstring's end
        prefix = source[:start] + body[:head_end] + "\n"
        suffix = source[start + len(body) :]
        fills.append(Fill(prefix[-CONTEXT_CHARS:], suffix[:CONTEXT_CHARS]))
    return fills


def edits() -> list[str]:
    """The library functions of bench.agentic's edits, each with one change asked for."""
    asks = []
    for i, (module, name, old, new) in enumerate(EDITS):
        _, function = _function(module, name)
        source = inspect.getsource(function)
        whole = "Answer with the whole function and nothing else."
        if i % 3 == 0:
            ask = f"Rename the variable `{old}` to `{new}` in this Python function. {whole}"
        elif i % 3 == 1:
            ask = f"Add a keyword parameter `strict=False` to this Python function. {whole}"
        else:
            at = source.rindex(old)
            source = source[:at] + old + "x" + source[at + len(old) :]
            ask = f"One line of this Python function misspells `{old}`. Fix it. {whole}"
        asks.append(f"{ask}\n\n```python\n{source}```")
    return asks


def chats() -> list[str]:
    return list(CHATS)
