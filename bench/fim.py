"""Fill in the middle as an editor sends it: the wait a client sees, ours against llama.cpp's.

    python -m bench.fim [--model qwen2.5-coder] [--ours auto none draft ngram suffix]
        [--llama-server PATH --gguf FILE --draft-gguf FILE] [--theirs none ngram-mod
        draft-simple@default draft-simple@3] [--rounds 1] [--temperatures 0] [--out F.json]

Ten cuts of the standard library's code (bench/code.py's kind of text, which none of the
models here wrote): 1,800 characters before the cut and 600 after, up to 48 tokens asked for;
the hole three lines; each cut sent cold, then again after the user typed the hole's first 4
characters (the prefix grown by them, as an editor sends it: it extends the first's).
Ours go to /v1/completions with `prompt` and `suffix` (the default server: `auto`, or one
drafter forced), llama.cpp's to its /infill (its prompt cache on, as an editor's plugin uses
it). One server at a time; each round runs every server in turn; medians over rounds and
cuts of the wall time of each request at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import inspect
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.common import text_table, write_json
from bench.peer import llama_spec_flags
from bench.served import serving

BEFORE, AFTER, TYPED, MAX_TOKENS = 1800, 600, 4, 48
CUTS = (  # (module, function): the cut falls a third of the way into the function's body
    ("textwrap", "TextWrapper._split"),
    ("shlex", "split"),
    ("heapq", "merge"),
    ("json.encoder", "JSONEncoder.iterencode"),
    ("fractions", "Fraction.__floordiv__"),
    ("statistics", "median_low"),
    ("string", "capwords"),
    ("csv", "Sniffer.has_header"),
    ("difflib", "SequenceMatcher.ratio"),
    ("ipaddress", "ip_network"),
)


@dataclass(frozen=True)
class Cut:
    prefix: str
    suffix: str
    typed: str  # what the user types next: the cut's true continuation's first characters


def cuts() -> list[Cut]:
    """Each function cut at the start of a line a third of the way into it; the hole its next
    three lines, the suffix what follows them; the user types the hole's indentation and its
    first 4 characters."""
    out = []
    for module, name in CUTS:
        target: Any = importlib.import_module(module)
        for part in name.split("."):
            target = getattr(target, part)
        source = inspect.getsource(importlib.import_module(module))
        body = inspect.getsource(target)
        start = source.index(body)
        lines = body.splitlines(keepends=True)
        third = max(1, len(lines) // 3)
        at = start + sum(len(line) for line in lines[:third])
        hole = "".join(lines[third : third + 3])
        indent = len(hole) - len(hole.lstrip())
        typed = hole[: indent + TYPED]
        out.append(Cut(source[:at][-BEFORE:], source[at + len(hole) :][:AFTER], typed))
    return out


def body(side: str, prefix: str, suffix: str, temperature: float) -> tuple[str, dict]:
    if side == "ours":
        fields = {"prompt": prefix, "suffix": suffix, "max_tokens": MAX_TOKENS}
        return "/v1/completions", fields | {"temperature": temperature, "seed": 1}
    fields = {"input_prefix": prefix, "input_suffix": suffix, "n_predict": MAX_TOKENS}
    return "/infill", fields | {"temperature": temperature, "seed": 1, "cache_prompt": True}


async def waits(url: str, side: str, temperature: float) -> list[tuple[float, float]]:
    """(cold, follow-up) seconds of each cut."""
    out = []
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as session:

        async def wait(prefix: str, suffix: str) -> float:
            route, fields = body(side, prefix, suffix, temperature)
            start = time.perf_counter()
            async with session.post(url + route, json=fields) as response:
                if response.status != 200:
                    raise RuntimeError(f"{side}: {response.status} {await response.text()}")
                await response.read()
            return time.perf_counter() - start

        for cut in cuts():
            cold = await wait(cut.prefix, cut.suffix)
            out.append((cold, await wait(cut.prefix + cut.typed, cut.suffix)))
    return out


def commands(args: argparse.Namespace) -> dict[str, tuple[str, list[str]]]:
    """Each server by its row name: (side, command line)."""
    ours = [sys.executable, "server.py", "--model", args.model, "--host", "127.0.0.1"]
    rows = {
        f"ours {spec}": ("ours", ours + ([] if spec == "auto" else ["--speculative", spec]))
        for spec in args.ours
    }
    if args.llama_server:
        base = [str(args.llama_server), "-m", str(args.gguf), "-t", "2", "-tb", "2"]
        base += ["-c", "8192", "--host", "127.0.0.1", "--no-webui"]
        for spec in args.theirs:  # drafts capped at 4 tokens, as ours, unless `@N` says
            flags = llama_spec_flags(spec, 4, args.draft_gguf)
            rows[f"llama.cpp {spec}"] = ("llama", base + flags)
    return rows


async def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, dict[float, list[tuple[float, float]]]] = {}
    logs = Path(tempfile.mkdtemp(prefix="bench-fim-"))
    for _ in range(args.rounds):
        for name, (side, command) in commands(args).items():
            log = logs / (name.replace(" ", "-").replace("@", "-") + ".log")
            async with serving(command, log, timeout=900) as (url, _):
                for temperature in args.temperatures:
                    got = await waits(url, side, temperature)
                    results.setdefault(name, {}).setdefault(temperature, []).extend(got)
    return {
        name: {
            str(t): {
                "cold_s": statistics.median(c for c, _ in pairs),
                "follow_up_s": statistics.median(f for _, f in pairs),
                "waits": pairs,
            }
            for t, pairs in by_t.items()
        }
        for name, by_t in results.items()
    }


def table(results: dict[str, Any]) -> str:
    rows = [
        [name, t, f"{cell['cold_s']:.2f}", f"{cell['follow_up_s']:.2f}"]
        for name, by_t in results.items()
        for t, cell in by_t.items()
    ]
    return text_table(["server", "temperature", "cold s", "follow-up s"], rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen2.5-coder")
    p.add_argument("--ours", nargs="*", default=["auto", "none", "draft", "ngram", "suffix"])
    p.add_argument("--llama-server", type=Path)
    p.add_argument("--gguf", type=Path, help="llama.cpp's target file")
    p.add_argument("--draft-gguf", type=Path, help="llama.cpp's draft model file")
    p.add_argument("--theirs", nargs="*", default=["none", "ngram-mod", "draft-simple@default"])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--temperatures", type=float, nargs="*", default=[0.0])
    p.add_argument("--out", type=Path)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = asyncio.run(run(args))
    print(table(results))
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
