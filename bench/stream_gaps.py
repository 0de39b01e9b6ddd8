"""How much a flood of large request bodies holds up a live stream.

Starts `server.py` (the flags after `--` go to it), opens one streamed completion, and records
when each chunk arrives: first alone, then while `--clients` clients post bodies of the largest
size the server accepts (a prompt string, and a chat message, of about `--body-bytes`), back to
back. Prints the stream's inter-chunk gaps (p50, p99, worst) in both phases and writes JSON.

    python -m bench.stream_gaps --out bench/results/stream_gaps.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

from bench.common import percentile, text_table
from bench.served import serving


def body_of_size(n: int, chat: bool) -> bytes:
    """A JSON body of about n bytes whose text the server must tokenize to refuse (its prompt is
    far past the context)."""

    def encoded(text: str) -> bytes:
        fields = {"messages": [{"role": "user", "content": text}]} if chat else {"prompt": text}
        return json.dumps(fields | {"max_tokens": 4}).encode()

    text = "def f(x):\n    return x + 1\n" * (n // 28)
    while len(body := encoded(text)) > n:
        text = text[: len(text) - (len(body) - n)]
    return body


async def flood(url: str, body: bytes, route: str, counts: list[int]) -> None:
    """Post `body` back to back until cancelled."""
    headers = {"Content-Type": "application/json"}
    async with aiohttp.ClientSession() as session:
        while True:
            async with session.post(url + route, data=body, headers=headers) as response:
                await response.read()
                counts.append(response.status)


async def stream_times(url: str, max_tokens: int, times: list[float]) -> None:
    """Append the arrival time of each chunk of one long streamed completion."""
    body = {"prompt": "import os\n", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    async with aiohttp.ClientSession() as session:
        async with session.post(url + "/v1/completions", json=body) as response:
            async for line in response.content:
                if line.startswith(b"data: ") and line.strip() != b"data: [DONE]":
                    times.append(time.monotonic())


def gaps_ms(times: list[float], start: float, end: float) -> list[float]:
    """The gaps that end after start and begin before end: a stall that outlasts the flood
    counts whole (to the first chunk after it)."""
    pairs = zip(times, times[1:], strict=False)
    return [(b - a) * 1000 for a, b in pairs if b > start and a < end]


def summary(gaps: list[float]) -> dict[str, float]:
    return {
        "chunks": len(gaps),
        "p50_ms": statistics.median(gaps),
        "p99_ms": percentile(gaps, 99),
        "worst_ms": max(gaps),
    }


async def measure(url: str, args: argparse.Namespace) -> dict:
    times: list[float] = []
    streaming = asyncio.create_task(stream_times(url, args.max_tokens, times))
    await asyncio.sleep(args.seconds)  # alone
    load_start = time.monotonic()
    statuses: list[int] = []
    bodies = [body_of_size(args.body_bytes, chat=chat) for chat in (False, True)]
    routes = ["/v1/completions", "/v1/chat/completions"]
    floods = [
        asyncio.create_task(flood(url, bodies[i % 2], routes[i % 2], statuses))
        for i in range(args.clients)
    ]
    await asyncio.sleep(args.seconds)
    load_end = time.monotonic()
    for task in floods:
        task.cancel()
    # the first chunk after the flood closes the last gap (a stall included)
    deadline = load_end + 60
    while (not times or times[-1] < load_end) and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    streaming.cancel()
    if not times or times[-1] < load_end:
        raise SystemExit("the stream ended before the load did: raise --max-tokens")
    return {
        "alone": summary(gaps_ms([t for t in times if t <= load_start], 0, load_start)),
        "flooded": summary(gaps_ms(times, load_start, load_end)),
        "flood_requests": len(statuses),
        "flood_statuses": sorted(set(statuses)),
    }


async def served_measure(command: list[str], args: argparse.Namespace) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".log") as log:
        async with serving(command, Path(log.name), timeout=180) as url:
            return await measure(url, args)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--body-bytes", type=int, default=(1 << 20) - 1024)
    parser.add_argument("--seconds", type=float, default=6.0, help="of each phase")
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--out", type=Path)
    parser.add_argument("server_args", nargs="*", help="flags for server.py (after --)")
    args = parser.parse_args(argv)
    # the demo unless the flags name another model (argparse takes a flag's last value)
    command = [sys.executable, "server.py", "--model", "demo", *args.server_args]
    result = asyncio.run(served_measure(command, args))
    rows = [
        [phase, r["chunks"], f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}", f"{r['worst_ms']:.1f}"]
        for phase, r in (("alone", result["alone"]), ("flooded", result["flooded"]))
    ]
    print(text_table(["stream", "chunks", "gap p50 ms", "gap p99 ms", "worst ms"], rows))
    print(f"{result['flood_requests']} flood requests, statuses {result['flood_statuses']}")
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
