"""Server load: many concurrent streaming clients, a share of them leaving mid-stream.

    python -m bench.load [--url URL] --clients 64 --disconnect-fraction 0.33 --max-tokens 64

Without --url it serves the built-in demo in-process on a free loopback port (`--server-args`
passes flags to it, e.g. "--speculative none"). It reports output tokens/s, time to first token
and inter-token latency (p50, p99), and checks that every client that stayed got its whole
answer and that /metrics shows every KV page free afterwards; it exits 1 when a check fails.
Tokens per chunk come from `stream_options.continuous_usage_stats`: a speculative step sends
several tokens in one chunk, and each of them is counted with its share of the wait.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import shlex
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import uvloop

from bench.common import metric, percentile, write_json
from client import TandemClient, TandemError

PROMPTS = [
    "Once upon a time, in a village by the sea,",
    "The history of the printing press begins",
    "def fibonacci(n):",
    "The three most important things to know about rivers are",
    "In the morning the market opened and",
    "Dear friend, I am writing to tell you that",
]
MAX_CLIENTS = 1024


@dataclass
class Outcome:
    """What one client saw."""

    leaves: bool  # this client disconnects halfway through its answer
    tokens: int = 0
    finish: str | None = None
    error: str | None = None
    ttft: float | None = None  # seconds from sending to the first token
    gaps: list[float] = field(default_factory=list)  # inter-token latency, one per later token


async def one_client(client: TandemClient, index: int, leaves: bool, args: Any) -> Outcome:
    out = Outcome(leaves)
    start = last = time.perf_counter()
    options = {"include_usage": True, "continuous_usage_stats": True}
    try:
        stream = await client.complete(
            PROMPTS[index % len(PROMPTS)],
            stream=True,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            ignore_eos=True,
            stream_options=options,
        )
        async for chunk in stream:
            now = time.perf_counter()
            new = chunk["usage"]["completion_tokens"] - out.tokens
            if new > 0:
                if out.ttft is None:
                    out.ttft = now - start
                else:
                    out.gaps += [(now - last) / new] * new
                out.tokens, last = out.tokens + new, now
            if chunk["choices"] and chunk["choices"][0]["finish_reason"]:
                out.finish = chunk["choices"][0]["finish_reason"]
            if leaves and out.tokens >= args.max_tokens // 2:
                await stream.aclose()  # closes the connection: the server must abort
                break
    except TandemError as e:
        out.error = str(e)
    except Exception as e:  # a load test reports a broken connection, it does not stop
        out.error = f"{type(e).__name__}: {e}"
    return out


async def pages_used_after(client: TandemClient, wait_s: float = 10.0) -> int | None:
    """tandem_kv_pages_used once it reaches 0, or after `wait_s` (pages of an aborted request
    return when the steps that write them end)."""
    deadline = time.monotonic() + wait_s
    while True:
        used = metric(await client.metrics(), "tandem_kv_pages_used")
        if used is None or used == 0 or time.monotonic() > deadline:
            return None if used is None else int(used)
        await asyncio.sleep(0.1)


async def run_load(url: str, args: Any) -> dict[str, Any]:
    """Run the clients against `url`; the results and the checks, as a dict."""
    leaving = round(args.clients * args.disconnect_fraction)
    async with TandemClient(url, api_key=args.api_key, timeout=args.timeout) as client:
        start = time.perf_counter()
        outcomes = await asyncio.gather(
            *(one_client(client, i, i < leaving, args) for i in range(args.clients))
        )
        wall = time.perf_counter() - start
        pages_used = await pages_used_after(client)
    stayed = [o for o in outcomes if not o.leaves]
    completed = [o for o in stayed if o.finish == "length" and o.tokens == args.max_tokens]
    gaps = [g for o in outcomes for g in o.gaps]
    ttfts = [o.ttft for o in outcomes if o.ttft is not None]
    tokens = sum(o.tokens for o in outcomes)
    return {
        "clients": args.clients,
        "left_mid_stream": leaving,
        "max_tokens": args.max_tokens,
        "wall_s": wall,
        "output_tokens": tokens,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(gaps, 50),
        "itl_p99_s": percentile(gaps, 99),
        "completed": len(completed),
        "stayed": len(stayed),
        "errors": sorted({o.error for o in outcomes if o.error}),
        "kv_pages_used_after": pages_used,
        "ok": len(completed) == len(stayed) and pages_used == 0,
    }


def report(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"clients              {r['clients']} ({r['left_mid_stream']} leave mid-stream), "
            f"max_tokens {r['max_tokens']}, {r['wall_s']:.2f} s",
            f"output tokens/s      {r['output_tokens_per_s']:.1f} ({r['output_tokens']} tokens)",
            f"TTFT p50 / p99       {r['ttft_p50_s'] * 1e3:.1f} / {r['ttft_p99_s'] * 1e3:.1f} ms",
            f"ITL  p50 / p99       {r['itl_p50_s'] * 1e3:.1f} / {r['itl_p99_s'] * 1e3:.1f} ms",
            f"completed            {r['completed']} / {r['stayed']} that stayed",
            f"kv pages used after  {r['kv_pages_used_after']}",
            *(f"error                {e}" for e in r["errors"]),
            "ok" if r["ok"] else "FAILED",
        ]
    )


@contextlib.asynccontextmanager
async def demo_server(server_args: str) -> AsyncIterator[str]:
    """The demo (or the model `server_args` names) served in-process on a free loopback port."""
    from engine.engine import AsyncEngine
    from server import config_from_args, start_server

    argv = ["--model", "demo", *shlex.split(server_args), "--host", "127.0.0.1", "--port", "0"]
    config, options = config_from_args(argv)
    engine = AsyncEngine(config)
    await engine.start()
    runner = await start_server(engine, options)
    try:
        host, port = runner.addresses[0][:2]
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()
        await engine.stop()


async def main_async(args: Any) -> dict[str, Any]:
    async with asyncio.timeout(args.timeout):
        if args.url:
            return await run_load(args.url, args)
        async with demo_server(args.server_args) as url:
            return await run_load(url, args)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server; default: serve the demo in-process")
    p.add_argument("--server-args", default="", help="flags of the in-process server.py")
    p.add_argument("--api-key", help="the server's API key, if it has one")
    p.add_argument("--clients", type=int, default=64, help="concurrent streaming clients")
    p.add_argument("--disconnect-fraction", type=float, default=0.33, help="share leaving halfway")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each client asks for")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--timeout", type=float, default=300.0, help="bound on the whole run, s")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)
    if not 1 <= args.clients <= MAX_CLIENTS:
        p.error(f"--clients must be in 1..{MAX_CLIENTS}")
    if not 0 <= args.disconnect_fraction <= 1:
        p.error("--disconnect-fraction must be in [0, 1]")
    if args.max_tokens < 2:
        p.error("--max-tokens must be at least 2 (a leaving client leaves halfway)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        results = uvloop.run(main_async(args))
    except TimeoutError:
        print(f"FAILED: the run took longer than --timeout {args.timeout} s", file=sys.stderr)
        return 1
    print(report(results))
    if args.json:
        write_json(args.json, results)
    return 0 if results["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
