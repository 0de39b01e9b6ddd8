"""Our server against llama.cpp's llama-server on this CPU: same weights, same prompts.

    python -m bench.peer --llama-server PATH --gguf FILE [--model DIR]
        [--draft DIR --draft-gguf FILE] [--eagle DIR] [--mtp DIR]
        [--methods auto plain draft ngram-simple ngram-mod eagle mtp hybrid suffix draft-default
        draft-n3 draft-n8 draft-n16] [--batches 1 4]
        [--temperatures 0 1] [--max-tokens 128] [--prompts 8] [--repeats 3] [--rounds 1]
        [--k 4] [--fixed-k] [--ttft-tokens 2000] [--weights W]
        [--workload text|chat|complete|code-chat|edits] [--out F.json]

One server runs at a time: ours `server.py --speculative
auto|none|draft|ngram|suffix|eagle|mtp|hybrid` (auto: with `--auto-draft`'s model, if given)
(its prefix cache off, as llama.cpp's prompt cache is), llama.cpp's `llama-server -np BATCH
--spec-type none|draft-simple|ngram-simple|ngram-mod`, its drafts capped at k tokens like ours
(`draft-default`: its draft model at its own default length; `draft-nN`: at N; its n-gram
lookup lengths its defaults; `--llama-args` appends flags, which win).
llama.cpp drafts k every step; ours lets its cost model choose 0..k unless
`--fixed-k`. Our one n-gram drafter is measured once and shown on both n-gram rows; EAGLE and
MTP are ours alone. Both servers see the same token ids (held-out texts, tokenized with the
target's tokenizer, sent to ours /v1/completions and llama.cpp's /completion), EOS ignored;
the other workloads go through both chat routes (chat, code-chat, edits: bench/code.py) or,
for `complete`, as a fill in the middle (ours a prefix and a suffix, llama.cpp the ids ours
makes of them), EOS honoured, their time to first token measured on their own prompts;
llama.cpp's prompt cache and its top-k, top-p and min-p off, so that temperature 1 samples
the model's own distribution on both sides.

A cell (method, batch, temperature) sends `--prompts` requests in groups of `batch`
concurrent ones; its tokens/s is output tokens over the groups' wall time at the client, the
median over the repeats of every round (`--rounds N` runs the whole plan N times, the sides
taking turns, so that the machine's drift over minutes reaches both). Acceptance is draft
tokens accepted over proposed: ours from /metrics, llama.cpp's from its responses' `timings`.
Time to first token: the median wall time of a one-token request on a `--ttft-tokens` prompt
at batch 1. The floor is the target's weight bytes as each server reports holding them (ours
from its plain launch) over the machine's read bandwidth, measured before any server starts:
the least time a batch-1 forward can take.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shlex
import statistics
import sys
import tempfile
import time
from argparse import Namespace
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.code import Fill, chats, completions, edits
from bench.common import (
    heldout_prompts,
    metric,
    read_bandwidth,
    request_groups,
    text_table,
    write_json,
)
from bench.served import serving
from engine.config import WEIGHTS
from models.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "models" / "demo"
CHAT_PROMPTS = ROOT / "train" / "chat_heldout_prompts.json"
JSON = dict[str, Any]
# method: (our --speculative, llama.cpp's --spec-type); None where that side lacks the method
METHODS: dict[str, tuple[str | None, str | None]] = {
    "auto": ("auto", None),  # our default: whatever pays, per request and step
    "plain": ("none", "none"),
    "draft": ("draft", "draft-simple"),
    "ngram-simple": ("ngram", "ngram-simple"),
    "ngram-mod": ("ngram", "ngram-mod"),
    "eagle": ("eagle", None),
    "mtp": ("mtp", None),
    "hybrid": ("hybrid", None),  # suffix decoding, else the draft model
    "suffix": ("suffix", None),
    # llama.cpp's draft model at its own default draft length, and at n-max 3, 8 and 16
    "draft-default": (None, "draft-simple@default"),
    **{f"draft-n{n}": (None, f"draft-simple@{n}") for n in (3, 8, 16)},
}
WORKLOADS = ("text", "chat", "complete", "code-chat", "edits")
# our /metrics counters of draft tokens proposed and accepted
SPEC_COUNTERS = [f"tandem_spec_decode_num_{n}_tokens_total" for n in ("draft", "accepted")]


# ---- the two servers: how each is started and spoken to ----


@dataclass(frozen=True)
class Reply:
    """What one completion response tells: prompt and output tokens, and its drafts if it
    says."""

    prompt: int
    tokens: int
    drafted: int = 0
    accepted: int = 0


def tandem_reply(body: JSON) -> Reply:
    usage = body["usage"]
    return Reply(usage["prompt_tokens"], usage["completion_tokens"])  # drafts: from /metrics


def llama_reply(body: JSON) -> Reply:
    t = body.get("timings", {})  # draft_n only when the request drafted at all
    if "usage" in body:  # the chat route
        prompt, tokens = body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]
    else:
        prompt, tokens = body["tokens_evaluated"], body["tokens_predicted"]
    return Reply(prompt, tokens, t.get("draft_n", 0), t.get("draft_n_accepted", 0))


@dataclass(frozen=True)
class FillPrompt:
    """A fill in the middle: ours gets the text and builds the ids (/v1/completions with a
    suffix), llama.cpp the very ids it builds (/completion)."""

    fill: Fill
    ids: list[int]


Prompt = list[int] | list[dict[str, str]] | FillPrompt  # ids, a chat's messages, a fill
CHAT_ROUTE = "/v1/chat/completions"  # both servers', the file's chat template on both sides


@dataclass(frozen=True)
class Side:
    """One server's completion protocol."""

    name: str
    route: str
    length_field: str  # the name of max_tokens
    fields: JSON  # sent with every request
    reply: Callable[[JSON], Reply]
    spec_metrics: bool  # acceptance from /metrics (else from the replies)

    def body(self, prompt: Prompt, max_tokens: int, temperature: float, seed: int) -> JSON:
        """Token ids with EOS ignored; (the chat route) messages, or a fill, EOS honoured."""
        common = {"temperature": temperature, "seed": seed} | self.fields
        if isinstance(prompt, FillPrompt):
            fill = {"prompt": prompt.fill.prefix, "suffix": prompt.fill.suffix}
            text = fill if self.name == TANDEM_NAME else {"prompt": prompt.ids}
            return common | text | {self.length_field: max_tokens}
        if prompt and isinstance(prompt[0], dict):
            return common | {"messages": prompt, "max_tokens": max_tokens}
        return common | {"prompt": prompt, "ignore_eos": True, self.length_field: max_tokens}

    def route_of(self, body: JSON) -> str:
        return CHAT_ROUTE if "messages" in body else self.route


TANDEM_NAME = "tandem"
TANDEM = Side(TANDEM_NAME, "/v1/completions", "max_tokens", {}, tandem_reply, spec_metrics=True)
# its prompt cache off; top-k, top-p and min-p off (ours are off by default)
LLAMA_FIELDS = {"cache_prompt": False, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
LLAMA = Side("llama.cpp", "/completion", "n_predict", LLAMA_FIELDS, llama_reply, False)


@dataclass(frozen=True)
class Launch:
    """One server process: its side, speculative method, slots (llama.cpp's -np; 0: ours,
    which takes any batch) and command line (the port is added at start)."""

    side: Side
    spec: str
    slots: int
    command: tuple[str, ...]


def tandem_launch(spec: str, args: Namespace) -> Launch:
    heads = {"draft": args.draft, "eagle": args.eagle, "mtp": args.mtp, "hybrid": args.draft}
    heads |= {"auto": args.auto_draft}  # None: the lookups alone
    command = [sys.executable, "server.py", "--model", str(args.model), "--speculative", spec]
    if heads.get(spec) is not None:
        command += ["--draft", str(heads[spec])]
    if spec == "hybrid" or (spec == "auto" and args.auto_draft is not None):
        command += ["--hybrid-head", "draft"]
    # no prefix cache: llama.cpp's prompt cache is off too, and repeats must prefill anew
    command += ["--no-prefix-cache"]
    command += ["--num-speculative-tokens", str(args.k), "--host", "127.0.0.1"]
    command += ["--fixed-k"] * args.fixed_k + shlex.split(args.server_args)
    command += ["--weights", args.weights]
    return Launch(TANDEM, spec, 0, tuple(command))


def llama_spec_flags(spec: str, k: int, draft_gguf: Path | None = None) -> list[str]:
    """llama-server's --spec-type and the flags that cap its drafts at k tokens (a draft
    model's at the n-max after '@', or none for '@default')."""
    spec, _, n_max = spec.partition("@")
    cap = [] if n_max == "default" else ["--spec-draft-n-max", n_max or str(k)]
    flags = {
        "none": [],
        "draft-simple": ["-md", str(draft_gguf), *cap],
        "ngram-simple": ["--spec-ngram-simple-size-m", str(k)],
        "ngram-mod": ["--spec-ngram-mod-n-max", str(k), "--spec-ngram-mod-n-min", "1"],
    }[spec]
    return ["--spec-type", spec, *flags]


def llama_launch(spec: str, slots: int, context: int, args: Namespace) -> Launch:
    """llama-server with `slots` slots of `context` tokens each."""
    threads = str(args.threads)
    command = [str(args.llama_server), "-m", str(args.gguf), "-t", threads, "-tb", threads]
    command += ["-np", str(slots), "-c", str(slots * context), "--host", "127.0.0.1"]
    flags = llama_spec_flags(spec, args.k, args.draft_gguf)
    command += ["--no-webui", *flags, *shlex.split(args.llama_args)]
    return Launch(LLAMA, spec, slots, tuple(command))


def launches(args: Namespace, context: int) -> list[Launch]:
    """Each server to run, in method order: ours per --speculative (it serves every batch),
    llama.cpp's per --spec-type and batch (-np); one that two methods share runs once."""
    out: dict[tuple, Launch] = {}
    for method in args.methods:
        ours, theirs = METHODS[method]
        if ours:
            out.setdefault((TANDEM.name, ours, 0), tandem_launch(ours, args))
        for batch in args.batches if theirs and not args.ours_only else []:
            # the batch-1 server also takes the time-to-first-token prompt
            ttft = args.ttft_tokens if args.workload == "text" else 0
            ctx = context if batch > 1 else max(context, ttft + 2 * args.k + 8)
            out.setdefault((LLAMA.name, theirs, batch), llama_launch(str(theirs), batch, ctx, args))
    return list(out.values())


# ---- measuring ----


@dataclass
class Cell:
    """One launch at one batch and temperature, over the repeats."""

    rates: list[float] = field(default_factory=list)  # output tokens/s, one per repeat
    drafted: int = 0
    accepted: int = 0
    prompt_tokens: list[int] = field(default_factory=list)  # each request's, the first repeat


@dataclass(frozen=True)
class Client:
    """Requests to one running server."""

    session: aiohttp.ClientSession
    url: str
    side: Side

    async def get(self, route: str) -> str:
        async with self.session.get(self.url + route) as response:
            return await response.text()

    async def post(self, body: JSON) -> JSON:
        async with self.session.post(self.url + self.side.route_of(body), json=body) as response:
            if response.status != 200:
                text = (await response.text())[:300]
                raise RuntimeError(f"{self.side.name}: HTTP {response.status}: {text}")
            return await response.json()

    async def group(
        self, prompts: list[Prompt], max_tokens: int, temperature: float, seed: int
    ) -> tuple[float, list[Reply]]:
        """Wall seconds of the prompts' requests sent at once (seeds counting up from `seed`),
        and their replies."""
        bodies = [
            self.side.body(p, max_tokens, temperature, seed + i) for i, p in enumerate(prompts)
        ]
        start = time.perf_counter()
        replies = await asyncio.gather(*(self.post(b) for b in bodies))
        return time.perf_counter() - start, [self.side.reply(r) for r in replies]

    async def spec_counts(self) -> list[int]:
        """Our drafted and accepted token counters, from /metrics."""
        text = await self.get("/metrics")
        return [int(metric(text, name) or 0) for name in SPEC_COUNTERS]

    async def weight_bytes(self) -> int:
        """The weight bytes the server holds: llama.cpp's target's (/v1/models), or ours
        (/metrics: the drafter's too, where it has one)."""
        if self.side is LLAMA:
            models = json.loads(await self.get("/v1/models"))
            return int(models["data"][0]["meta"]["size"])
        return int(metric(await self.get("/metrics"), 'tandem_memory_bytes{kind="weights"}') or 0)


async def measure_cell(
    client: Client, groups: list[list[Prompt]], temperature: float, args: Namespace
) -> Cell:
    cell = Cell()
    before = await client.spec_counts() if client.side.spec_metrics else None
    for repeat in range(args.repeats):
        tokens, seconds = 0, 0.0
        for g, group in enumerate(groups):
            seed = 1000 * repeat + g * len(group)
            elapsed, replies = await client.group(group, args.max_tokens, temperature, seed)
            seconds += elapsed
            tokens += sum(r.tokens for r in replies)
            if repeat == 0:
                cell.prompt_tokens += [r.prompt for r in replies]
            cell.drafted += sum(r.drafted for r in replies)
            cell.accepted += sum(r.accepted for r in replies)
        cell.rates.append(tokens / seconds)
    if before is not None:
        after = await client.spec_counts()
        cell.drafted, cell.accepted = after[0] - before[0], after[1] - before[1]
    return cell


async def measure_launch(
    launch: Launch, prompts: list[Prompt], ttft_prompts: list[Prompt], args: Namespace
) -> JSON:
    """Every cell a launch serves, its time to first token at batch 1, and its target's weight
    bytes (a plain launch's, on our side)."""
    batches = [launch.slots] if launch.slots else args.batches
    log = args.log_dir / f"{launch.side.name}-{launch.spec}-np{launch.slots}.log"
    timeout = aiohttp.ClientTimeout(total=None, sock_read=args.request_timeout)
    result: JSON = {"cells": {}}
    async with serving(launch.command, log, args.startup_timeout) as (url, _):
        async with aiohttp.ClientSession(timeout=timeout) as session:
            client = Client(session, url, launch.side)
            for batch in batches:
                groups = request_groups(prompts, batch, args.prompts)
                await client.group(groups[0], 8, 0.0, 0)  # warm-up, untimed
                for temp in args.temperatures:
                    result["cells"][(batch, temp)] = await measure_cell(client, groups, temp, args)
            if ttft_prompts and 1 in batches:  # one-token greedy requests' wall times
                ttfts = [
                    await client.group([p], 1, 0.0, s)
                    for s in range(args.repeats)
                    for p in ttft_prompts
                ]
                result["ttft"] = statistics.median(seconds for seconds, _ in ttfts)
            if launch.side is LLAMA or launch.spec == "none":
                result["weight_bytes"] = await client.weight_bytes()
    return result


# ---- inputs ----


def bench_prompts(
    tokenizer: Tokenizer, count: int, ttft_tokens: int, workload: str = "text"
) -> tuple[list[Prompt], list[Prompt]]:
    """The workload's first `count` requests, and those whose time to first token is
    measured (none for --ttft-tokens 0): text's, a prompt of exactly `ttft_tokens` ids (all
    of the held-out texts joined); the other workloads', their own requests."""
    if workload != "text":
        prompts = workload_prompts(tokenizer, workload)[:count]
        return prompts, prompts if ttft_tokens else []
    texts = heldout_prompts(64)
    ids: list[Prompt] = [tokenizer.encode(text) for text in texts[:count]]
    if not ttft_tokens:
        return ids, []
    joined = [t for text in texts for t in tokenizer.encode(text + "\n")]
    if len(joined) < ttft_tokens:
        raise RuntimeError(f"the held-out texts hold {len(joined)} tokens, under --ttft-tokens")
    return ids, [joined[:ttft_tokens]]


def workload_prompts(tokenizer: Tokenizer, workload: str) -> list[Prompt]:
    """chat: the held-out chat questions; the code workloads of bench/code.py."""
    if workload == "complete":
        return [FillPrompt(f, tokenizer.encode_fill(f.prefix, f.suffix)) for f in completions()]
    questions = {"chat": lambda: json.loads(CHAT_PROMPTS.read_text()), "code-chat": chats}
    texts = questions[workload]() if workload in questions else edits()
    return [[{"role": "user", "content": text}] for text in texts]


def prompt_length(tokenizer: Tokenizer, prompt: Prompt) -> int:
    if isinstance(prompt, FillPrompt):
        return len(prompt.ids)
    if prompt and isinstance(prompt[0], dict):
        return len(tokenizer.encode_chat(prompt))  # type: ignore[arg-type]
    return len(prompt)


# ---- rows and outputs ----


def merged(earlier: JSON, later: JSON) -> JSON:
    """One launch's results over its rounds so far: every cell's repeats together, time to
    first token the mean of the rounds' medians."""
    out = dict(later)
    out["cells"] = {
        key: Cell(
            a.rates + b.rates, a.drafted + b.drafted, a.accepted + b.accepted, a.prompt_tokens
        )
        for (key, a), b in zip(earlier["cells"].items(), later["cells"].values(), strict=True)
    }
    if "ttft" in earlier:
        rounds = earlier.get("rounds", 1)
        out["ttft"] = (earlier["ttft"] * rounds + later["ttft"]) / (rounds + 1)
    out["rounds"] = earlier.get("rounds", 1) + 1
    return out


def launch_key(side: Side, method: str, batch: int) -> tuple[str, str, int] | None:
    """The launch that measured a side's method at a batch; None where the side lacks it."""
    spec = METHODS[method][side is LLAMA]
    return None if spec is None else (side.name, spec, batch if side is LLAMA else 0)


def cell_json(cell: Cell) -> JSON:
    acceptance = cell.accepted / cell.drafted if cell.drafted else None
    summary = {
        "drafted": cell.drafted,
        "accepted": cell.accepted,
        "acceptance": acceptance,
        "prompt_tokens": cell.prompt_tokens,
    }
    return {"tokens_per_s": statistics.median(cell.rates), "rates": cell.rates} | summary


def build_rows(results: dict[tuple, JSON], args: Namespace) -> list[JSON]:
    """One row per method, batch and temperature, with each side's cell where it has one."""
    rows = []
    for method, batch, temp in itertools.product(args.methods, args.batches, args.temperatures):
        row: JSON = {"method": method, "batch": batch, "temperature": temp}
        for side in (TANDEM, LLAMA):
            if (key := launch_key(side, method, batch)) in results:
                row[side.name] = cell_json(results[key]["cells"][(batch, temp)])
        rows.append(row)
    return rows


def ttft_rows(results: dict[tuple, JSON], args: Namespace) -> dict[str, JSON]:
    """Per method, each side's time to first token in seconds (batch 1)."""
    rows: dict[str, JSON] = {}
    for method, side in itertools.product(args.methods, (TANDEM, LLAMA)):
        key = launch_key(side, method, 1)
        if key in results and "ttft" in results[key]:
            rows.setdefault(method, {})[side.name] = results[key]["ttft"]
    return rows


def sides(row: JSON) -> list[JSON]:
    return [row[side.name] for side in (TANDEM, LLAMA) if side.name in row]


def ratio(ours: float | None, theirs: float | None) -> str:
    return f"{ours / theirs:.2f}x" if ours and theirs else "-"


def cell_texts(cell: JSON | None) -> list[str]:
    """tokens/s and accepted/drafted (share) of one side's cell, or dashes."""
    if not cell:
        return ["-", "-"]
    if not cell["drafted"]:
        return [f"{cell['tokens_per_s']:.1f}", "-"]
    drafts = f"{cell['accepted']}/{cell['drafted']} ({cell['acceptance']:.0%})"
    return [f"{cell['tokens_per_s']:.1f}", drafts]


def speed_table(rows: list[JSON], floor_ms: dict[str, float]) -> str:
    """Each side's speed and acceptance per cell, their ratio and the floors."""
    floor = " / ".join(f"{floor_ms.get(side.name, 0):.1f}" for side in (TANDEM, LLAMA))
    lines = []
    for row in rows:
        ours, theirs = row.get(TANDEM.name), row.get(LLAMA.name)
        speeds = [c["tokens_per_s"] if c else None for c in (ours, theirs)]
        head = [row["method"], str(row["batch"]), f"{row['temperature']:g}"]
        lines.append(head + cell_texts(ours) + cell_texts(theirs) + [ratio(*speeds), floor])
    header = ["method", "batch", "T", "tandem tok/s", "accepted", "llama.cpp tok/s", "accepted"]
    return text_table(header + ["tandem / llama.cpp", "floor ms (tandem / llama.cpp)"], lines)


def ttft_table(rows: dict[str, JSON], tokens: int) -> str:
    lines = []
    for method, row in rows.items():
        ours, theirs = row.get(TANDEM.name), row.get(LLAMA.name)
        ms = [f"{1000 * s:.0f}" if s else "-" for s in (ours, theirs)]
        lines.append([method, *ms, ratio(theirs, ours)])  # shorter is better: theirs over ours
    header = [f"method ({tokens}-token prompt)", "tandem TTFT ms", "llama.cpp TTFT ms"]
    return text_table([*header, "llama.cpp / tandem"], lines)


# ---- command line ----


def parse_args(argv: Sequence[str] | None = None) -> Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.peer", description=__doc__.split("\n")[0])
    p.add_argument("--llama-server", type=Path, required=True, help="llama.cpp's llama-server")
    p.add_argument("--gguf", type=Path, required=True, help="the target for llama.cpp")
    p.add_argument("--model", type=Path, default=DEMO / "target", help="our target directory")
    p.add_argument("--draft", type=Path, default=DEMO / "draft", help="our draft model")
    p.add_argument("--draft-gguf", type=Path, help="the draft model for llama.cpp")
    p.add_argument("--eagle", type=Path, default=DEMO / "eagle", help="our EAGLE head")
    p.add_argument("--mtp", type=Path, default=DEMO / "mtp", help="our MTP head")
    p.add_argument("--auto-draft", type=Path, help="the model our `auto` may draft with")
    p.add_argument("--ours-only", action="store_true", help="our servers alone: no llama.cpp")
    p.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request")
    p.add_argument("--prompts", type=int, default=8, help="requests per cell (>= one batch)")
    p.add_argument("--repeats", type=int, default=3, help="of each cell (median)")
    p.add_argument("--rounds", type=int, default=1, help="runs of the plan, the sides in turn")
    p.add_argument("--k", type=int, default=4, help="draft tokens a step, at most (both sides)")
    p.add_argument("--fixed-k", action="store_true", help="ours drafts k every step")
    p.add_argument("--ttft-tokens", type=int, default=2000, help="its prompt; 0: none")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp's -t and the bandwidth's")
    p.add_argument("--server-args", default="", help="more flags for server.py")
    p.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="text",
        help="text: held-out texts as ids, EOS ignored; chat: held-out chat questions; "
        "complete, code-chat, edits: bench/code.py's (EOS honoured but in text)",
    )
    p.add_argument("--weights", choices=WEIGHTS, default="auto", help="our server's --weights")
    p.add_argument("--llama-args", default="", help="more flags for llama-server")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    p.add_argument("--log-dir", type=Path, help="server logs (default: a new temporary folder)")
    p.add_argument("--out", type=Path, default=Path("bench/results/peer.json"))
    args = p.parse_args(argv)
    if "draft" in args.methods and args.draft_gguf is None:
        p.error("--methods draft needs --draft-gguf")
    if min(args.batches) < 1 or min(args.max_tokens, args.prompts, args.repeats, args.rounds) < 1:
        p.error("--batches, --max-tokens, --prompts, --repeats and --rounds must be at least 1")
    if args.ttft_tokens < 0:
        p.error("--ttft-tokens must not be negative")
    args.log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="bench-peer-"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    return args


def run(args: Namespace) -> JSON:
    """The whole comparison: prints the tables, writes the JSON, returns the report."""
    start = time.perf_counter()
    bandwidth = read_bandwidth(args.threads)  # before any server takes the cores
    tokenizer = Tokenizer(args.model)
    prompts, ttft_prompts = bench_prompts(tokenizer, args.prompts, args.ttft_tokens, args.workload)
    longest = max(prompt_length(tokenizer, p) for p in prompts)
    plan = launches(args, longest + args.max_tokens + 2 * args.k + 8)
    results: dict[tuple, JSON] = {}
    for round_ in range(args.rounds):  # the sides take turns: the machine's drift hits both
        for launch in plan:
            print(
                f"bench.peer: round {round_ + 1}: {launch.side.name} {launch.spec} "
                f"(np {launch.slots})",
                flush=True,
            )
            key = (launch.side.name, launch.spec, launch.slots)
            result = asyncio.run(measure_launch(launch, prompts, ttft_prompts, args))
            results[key] = merged(results[key], result) if key in results else result
    weights = {}  # every llama.cpp launch holds the same GGUF
    for (side, _, _), result in results.items():
        if "weight_bytes" in result:
            weights[side] = result["weight_bytes"]
    floor_ms = {side: 1000 * n / bandwidth for side, n in weights.items()}
    rows, ttft = build_rows(results, args), ttft_rows(results, args)
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s; weights (MB): ", end="")
    print(", ".join(f"{side} {n / 1e6:.0f}" for side, n in weights.items()))
    print(speed_table(rows, floor_ms))
    unequal = [r for r in rows if len({tuple(c["prompt_tokens"]) for c in sides(r)}) > 1]
    print("prompt tokens " + ("differ: " + str(unequal[0]) if unequal else "equal on both sides"))
    if ttft:
        print(ttft_table(ttft, args.ttft_tokens))
    report = {
        "args": vars(args),
        "bandwidth_bytes_per_s": bandwidth,
        "weight_bytes": weights,
        "floor_ms": floor_ms,
        "commands": [launch.command for launch in plan],
        "rows": rows,
        "ttft_s": ttft,
        "seconds": time.perf_counter() - start,
    }
    write_json(args.out, report)
    print(f"wrote {args.out}; server logs in {args.log_dir}")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        run(args)
    except RuntimeError as error:
        print(f"bench.peer: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
