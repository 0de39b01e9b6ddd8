"""A server's resident memory beside what it must hold: its weights and its KV cache.

    python -m bench.memory [--idle 10] [-- SERVER ARGS...]

Starts `python server.py SERVER ARGS` (default: the shipped SmolLM2 with its default
drafter), sends one chat request, waits `--idle` seconds, and reads the process tree's
resident set (VmRSS) beside the weights and KV cache the server reports
(`tandem_memory_bytes`). What is left over is the runtime's own: Python, torch and its
allocator, the tokenizer, scratch buffers.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
from pathlib import Path

import aiohttp

from bench.common import metric, text_table
from bench.served import serving

MIB = 2**20


def resident_bytes(pid: int) -> int:
    """VmRSS of `pid` and of its children (tensor-parallel ranks)."""
    total = 0
    for p in [pid, *children(pid)]:
        for line in Path(f"/proc/{p}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                total += int(line.split()[1]) * 1024
    return total


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        kids = (task / "children").read_text().split()
        for kid in map(int, kids):
            found += [kid, *children(kid)]
    return found


async def measure(server_args: list[str], idle: float) -> dict[str, float]:
    """Resident bytes after one chat request and `idle` seconds, the weights' and the KV
    cache's (what the server reports)."""
    command = [sys.executable, "server.py", *server_args]
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        async with serving(command, Path(log.name), timeout=600) as (url, process):
            async with aiohttp.ClientSession() as session:
                body = {"messages": [{"role": "user", "content": "Name three rivers."}],
                        "max_tokens": 64}  # fmt: skip
                async with session.post(url + "/v1/chat/completions", json=body) as r:
                    r.raise_for_status()
                await asyncio.sleep(idle)
                resident = resident_bytes(process.pid)
                async with session.get(url + "/metrics") as r:
                    metrics = await r.text()
    kinds = ("weights", "kv_cache")
    held = {k: metric(metrics, f'tandem_memory_bytes{{kind="{k}"}}') or 0.0 for k in kinds}
    return {"resident": resident, **held}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=10.0, help="seconds after the request")
    args = parser.parse_args(argv[:split])
    r = asyncio.run(measure(argv[split + 1 :], args.idle))
    rest = r["resident"] - r["weights"] - r["kv_cache"]
    header = ["resident MiB", "weights MiB", "KV cache MiB", "the rest MiB"]
    row = [f"{r[k] / MIB:.0f}" for k in ("resident", "weights", "kv_cache")] + [f"{rest / MIB:.0f}"]
    print(text_table(header, [row]))


if __name__ == "__main__":
    main()
