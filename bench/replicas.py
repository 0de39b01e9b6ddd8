"""Engine replicas behind one endpoint (server.py --replicas N) against one server.

Two workloads, each against servers started here, one after the other:
- chats: `--chats` concurrent chats of `--turns` turns, in groups that share a system prompt
  (`--systems` of them); the server alone, 2 replicas routed by prefix, 2 replicas under Ray
  Serve's default routing. Tokens/s over the run and the first token's wait per turn.
- overhead: requests one at a time (batch 1) through one replica behind the endpoint against
  the server alone, with the same CPUs: decoding tokens/s and the first token's wait.

    python -m bench.replicas --model demo --json bench/results/replicas-demo.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench.common import percentile, text_table, write_json
from bench.served import serving

TOPICS = ["castles", "rivers", "gardens", "ships", "forests", "bridges", "markets", "songs"]
QUESTIONS = ["Tell me about it.", "And then what happened?", "Why?", "Say more.", "Go on."]


@dataclass
class Turn:
    first_token_s: float  # request sent to the first content
    seconds: float  # request sent to the end
    tokens: int  # completion tokens


def system_prompt(group: int, words: int) -> str:
    """A long instruction shared by a group of chats."""
    topic = TOPICS[group % len(TOPICS)]
    body = " ".join(f"{TOPICS[(group + i) % len(TOPICS)]} {i}" for i in range(words // 2))
    return f"You are a storyteller who knows about {topic}. Remember these notes: {body}."


async def turn(
    session: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], max_tokens: int
) -> tuple[Turn, str]:
    """One streamed chat turn: its timings and its reply."""
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start, first, text, tokens = time.monotonic(), None, [], 0
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"]["message"])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk["choices"]:
                if content := choice["delta"].get("content"):
                    first = first if first is not None else time.monotonic() - start
                    text.append(content)
    assert first is not None, "no content"
    return Turn(first, time.monotonic() - start, tokens), "".join(text)


async def chat(url: str, system: str, index: int, args: argparse.Namespace) -> list[Turn]:
    messages = [{"role": "system", "content": system}]
    turns = []
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for t in range(args.turns):
            messages.append({"role": "user", "content": QUESTIONS[(index + t) % len(QUESTIONS)]})
            done, reply = await turn(session, url, messages, args.max_tokens)
            messages.append({"role": "assistant", "content": reply})
            turns.append(done)
    return turns


async def chats(url: str, args: argparse.Namespace) -> dict[str, Any]:
    systems = [system_prompt(g, args.system_words) for g in range(args.systems)]
    start = time.monotonic()
    runs = [chat(url, systems[c % args.systems], c, args) for c in range(args.chats)]
    done = await asyncio.gather(*runs)
    seconds = time.monotonic() - start
    every = [t for turns in done for t in turns]
    later = [t.first_token_s for turns in done for t in turns[1:]]  # the chat's prefix cached
    return {
        "tokens_per_s": sum(t.tokens for t in every) / seconds,
        "first_token_p50_s": percentile([t.first_token_s for t in every], 50),
        "first_token_p90_s": percentile([t.first_token_s for t in every], 90),
        "later_turns_first_token_p50_s": percentile(later, 50),
        "seconds": seconds,
        "turns": len(every),
        "turns_by_replica": await turns_by_replica(url),
    }


async def turns_by_replica(url: str) -> dict[str, float]:
    """Each replica's finished requests, from /metrics (nothing for one server)."""
    await asyncio.sleep(2.0)  # the endpoint's /metrics is up to a second old
    async with aiohttp.ClientSession() as session, session.get(url + "/metrics") as response:
        text = await response.text()
    found: dict[str, float] = {}
    pattern = r'^tandem_requests_finished_total\{reason="\w+",replica="(\w+)"\} (\S+)$'
    for replica, value in re.findall(pattern, text, re.MULTILINE):
        found[replica] = found.get(replica, 0.0) + float(value)
    return found


async def batch_one(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Chats one at a time: decoding tokens/s and the first token's wait."""
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    runs = []
    async with aiohttp.ClientSession(timeout=timeout) as session:
        await turn(session, url, [{"role": "user", "content": "Hello"}], 8)  # warm
        for i in range(args.requests):
            question = f"{QUESTIONS[i % len(QUESTIONS)]} ({TOPICS[i % len(TOPICS)]})"
            done, _ = await turn(session, url, [{"role": "user", "content": question}], 128)
            runs.append(done)
    decode = [(t.tokens - 1) / (t.seconds - t.first_token_s) for t in runs]
    return {
        "decode_tokens_per_s": percentile(decode, 50),
        "first_token_p50_s": percentile([t.first_token_s for t in runs], 50),
        "runs": [asdict(t) for t in runs],
    }


def server(args: argparse.Namespace, *flags: str) -> list[str]:
    return [sys.executable, "server.py", "--model", args.model, *args.server_args, *flags]


async def measure(args: argparse.Namespace) -> dict[str, Any]:
    log, results = args.log, {}
    if "chats" in args.workloads:
        setups = {
            "one server": server(args),
            "2 replicas, prefix": server(args, "--replicas", "2"),
            "2 replicas, ray": server(args, "--replicas", "2", "--replica-routing", "ray"),
        }
        for name, command in setups.items():
            async with serving(command, log, args.start_timeout) as (url, _):
                results[f"chats: {name}"] = await chats(url, args)
    if "overhead" in args.workloads:
        cpus = ["--replicas", "1", "--replica-cpus", "2"]
        setups = {"one server": server(args), "1 replica": server(args, *cpus)}
        rounds: dict[str, list[dict[str, Any]]] = {name: [] for name in setups}
        for _ in range(args.rounds):  # the two in turn, so that the machine's drift hits both
            for name, command in setups.items():
                async with serving(command, log, args.start_timeout) as (url, _):
                    rounds[name].append(await batch_one(url, args))
        for name, measured in rounds.items():
            results[f"batch 1: {name}"] = {
                "decode_tokens_per_s": statistics.median(
                    r["decode_tokens_per_s"] for r in measured
                ),
                "first_token_p50_s": statistics.median(r["first_token_p50_s"] for r in measured),
                "rounds": measured,
            }
    return results


def report(results: dict[str, Any]) -> str:
    rows = []
    for name, r in results.items():
        if name.startswith("chats"):
            waits = ("first_token_p50_s", "first_token_p90_s", "later_turns_first_token_p50_s")
            rows.append([name, f"{r['tokens_per_s']:.1f}", *(f"{r[w] * 1e3:.0f}" for w in waits)])
        else:
            wait = f"{r['first_token_p50_s'] * 1e3:.0f}"
            rows.append([name, f"{r['decode_tokens_per_s']:.1f}", wait, "", ""])
    header = ["setup", "tokens/s", "first token p50 ms", "p90 ms", "later turns p50 ms"]
    return text_table(header, rows)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.replicas", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="demo", help="what server.py --model serves")
    p.add_argument("--server-args", nargs="*", default=[], help="more flags of every server")
    workloads = ["chats", "overhead"]
    p.add_argument("--workloads", nargs="+", default=workloads, choices=workloads)
    p.add_argument("--chats", type=int, default=16, help="concurrent chats")
    p.add_argument("--turns", type=int, default=3, help="turns a chat")
    p.add_argument("--systems", type=int, default=4, help="system prompts the chats share")
    p.add_argument("--system-words", type=int, default=300, help="a system prompt's length")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens a chat turn")
    p.add_argument("--requests", type=int, default=6, help="batch-1 requests a setup")
    p.add_argument("--rounds", type=int, default=1, help="overhead: the setups in turn, N times")
    p.add_argument("--start-timeout", type=float, default=300.0, help="seconds a server may take")
    p.add_argument("--log", type=Path, default=Path("/tmp/tandem-bench-replicas.log"))
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results = uvloop.run(measure(args))
    print(report(results))
    if args.json:
        write_json(args.json, {"model": args.model, "args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
