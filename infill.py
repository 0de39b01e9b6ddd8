"""llama.cpp's `/infill`, for the editor plugins that speak it (llama.vim, llama.vscode).

The fields they send are each honoured or, where they only tune llama.cpp's own machinery,
accepted and documented (docs/serving.md); any other field is a 400 that names it. The prompt
is built as llama.cpp's server builds it (`format_prompt_infill` in its tools/server), token
for token: the other files (`input_extra`) behind the repository and file-separator markers
where the vocabulary has them, then the prefix (its last 3/4 of a batch), the prompt, the
suffix (the rest of a quarter batch) and the middle marker. The reply and the stream have
llama.cpp's shapes (`content`, `stop`, `tokens_predicted`, `timings`). Generation is the
engine's, under whatever drafter it runs: lossless as every route is.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterable, Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from api import JSON, ApiError, Engine, Tokenizer, check_model
from core.params import INT32_MAX, SamplingParams
from core.request import Delta, FinishReason

N_BATCH = 2048  # llama-server's default --batch-size: the prefix and suffix fit one batch
# llama.cpp's sampling defaults (common_params_sampling), where a request names none
DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}
REPOSITORY = "myproject\n"  # what llama.cpp names the repository (it takes no name)
CURRENT_FILE = "filename\n"  # ... and the file being edited
SNIPPET = "\n\n--- snippet ---\n\n"  # another file's start without a file-separator token

Check = Callable[[Any], bool]


def _int(lo: int, hi: int = INT32_MAX) -> Check:
    return lambda v: type(v) is int and lo <= v <= hi


def _number(lo: float, hi: float) -> Check:
    return lambda v: type(v) in (int, float) and lo <= v <= hi


def _strings(v: Any) -> bool:
    return type(v) is list and all(type(s) is str for s in v)


def _chunk(c: Any) -> bool:
    """An `input_extra` chunk: {text, filename?, time?} (time: when the plugin took it)."""
    return (
        type(c) is dict
        and set(c) <= {"text", "filename", "time"}
        and type(c.get("text")) is str
        and type(c.get("filename", "")) is str
    )


# name: (check, what it must be). Honoured unless said otherwise in docs/serving.md.
FIELDS: dict[str, tuple[Check, str]] = {
    "input_prefix": (lambda v: type(v) is str, "a string"),
    "input_suffix": (lambda v: type(v) is str, "a string"),
    "input_extra": (
        lambda v: type(v) is list and all(map(_chunk, v)),
        "a list of {text, filename}",
    ),
    "prompt": (lambda v: type(v) is str, "a string"),
    "n_predict": (_int(-1), f"an integer in [-1, {INT32_MAX}] (-1: no limit, 0: cache only)"),
    "stop": (lambda v: type(v) is str or (_strings(v) and len(v) <= 16), "a list of strings"),
    "n_indent": (_int(0), "a non-negative integer"),
    "temperature": (_number(0, 100), "a number in [0, 100] (0: greedy)"),
    "top_k": (_int(-1), "an integer (0 or less: off)"),
    "top_p": (lambda v: _number(0, 1)(v) and v > 0, "a number in (0, 1]"),
    "min_p": (_number(0, 1), "a number in [0, 1]"),
    "seed": (_int(-1, 2**63 - 1), "an integer (-1: none)"),
    "stream": (lambda v: type(v) is bool, "a boolean"),
    "cache_prompt": (lambda v: type(v) is bool, "a boolean"),
    "t_max_prompt_ms": (_int(-1), "an integer"),
    "t_max_predict_ms": (_int(-1), "an integer (0 or less: no limit)"),
    "response_fields": (_strings, "a list of field paths (timings/prompt_n)"),
    "model": (lambda v: type(v) is str, "a string"),
    # llama.cpp's machinery alone: its sampler chain's order, its slots, its completions count
    "samplers": (lambda v: type(v) is str or _strings(v), "a list of sampler names"),
    "id_slot": (_int(-1), "an integer"),
    "n_cmpl": (_int(1, 1), "1 (one completion per request)"),
}
REQUIRED = ("input_prefix", "input_suffix")


def validate(body: Any) -> JSON:
    """The body's non-null fields, checked; an unknown or bad field is a 400 naming it."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    for name, value in body.items():
        if name not in FIELDS:
            raise ApiError(400, f"'{name}' is not a field /infill supports", param=name)
        check, what = FIELDS[name]
        if value is not None and not check(value):
            raise ApiError(400, f"'{name}' must be {what}", param=name)
    for name in REQUIRED:
        if body.get(name) is None:
            raise ApiError(400, f"'{name}' is required", param=name)
    return {name: value for name, value in body.items() if value is not None}


# ---------------------------------------------------------------------------------------------
# The prompt


def prompt_ids(fields: JSON, tokenizer: Tokenizer, n_ctx: int, n_batch: int = N_BATCH) -> list[int]:
    """llama.cpp's infill prompt: [BOS] other files, then <prefix marker> prefix prompt
    <suffix marker> suffix <middle marker>; the prefix keeps its last 3/4 of a batch, the
    suffix its first (1/4 of a batch - 2 - the prompt's tokens), the other files the last
    (n_ctx - n_batch + 2) tokens (llama.cpp's 2 * n_predict, at its server's default -1)."""
    if tokenizer.fim_ids is None:
        raise ApiError(400, "/infill: this model has no fill-in-the-middle tokens")
    pre, suf, mid = tokenizer.fim_ids
    prefix = tokenizer.encode_text(fields["input_prefix"])
    suffix = tokenizer.encode_text(fields["input_suffix"])
    prompt = tokenizer.encode(fields.get("prompt", ""), add_special_tokens=False)
    extra = extra_ids(fields.get("input_extra", []), tokenizer)
    prefix = prefix[len(prefix) - min(len(prefix), 3 * (n_batch // 4)) :]
    suffix = suffix[: max(0, n_batch // 4 - (2 + len(prompt)))]
    extra = extra[len(extra) - min(max(0, n_ctx - n_batch + 2), len(extra)) :]
    bos = (
        [tokenizer.bos_token_id]
        if tokenizer.adds_bos and tokenizer.bos_token_id is not None
        else []
    )
    return [*extra, *bos, pre, *prefix, *prompt, suf, *suffix, mid]


def extra_ids(chunks: list[JSON], tokenizer: Tokenizer) -> list[int]:
    """The other files: <repo> myproject, then per file <file sep> its name and its text (a
    snippet line where there is no file separator), then <file sep> filename (the file being
    edited)."""
    repo, file = tokenizer.fim_repo_ids
    ids = [repo, *tokenizer.encode_text(REPOSITORY)] if repo is not None else []
    for chunk in chunks:
        if file is not None:
            ids += [file, *tokenizer.encode_text(chunk.get("filename", "tmp") + "\n")]
        else:
            ids += tokenizer.encode_text(SNIPPET)
        ids += tokenizer.encode_text(chunk["text"])
    if file is not None:
        ids += [file, *tokenizer.encode_text(CURRENT_FILE)]
    return ids


# ---------------------------------------------------------------------------------------------
# The job and its reply


@dataclass
class InfillJob:
    """A checked /infill request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    fields: JSON


def make_job(fields: JSON, engine: Engine, model: str) -> InfillJob:
    """The prompt and the sampling parameters (llama.cpp's defaults where a field is absent)."""
    check_model(fields, model)
    ids = prompt_ids(fields, engine.tokenizer, engine.max_model_len)
    if len(ids) >= engine.max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {engine.max_model_len} tokens; the infill "
            f"prompt has {len(ids)}",
            code="context_length_exceeded",
        )
    n_predict = fields.get("n_predict", -1)
    rest = engine.max_model_len - len(ids)
    # 0 (a plugin's warm-up, to cache the context) yields one token, as llama.cpp's does
    max_tokens = rest if n_predict == -1 else min(max(n_predict, 1), rest)
    sampling = DEFAULTS | {k: fields[k] for k in DEFAULTS if k in fields}
    stop = fields.get("stop", [])
    seed = fields.get("seed", -1)
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=sampling["temperature"],
        top_k=max(sampling["top_k"], 0),
        top_p=sampling["top_p"],
        min_p=sampling["min_p"],
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=engine.tokenizer.fim_stop_ids,
        seed=None if seed < 0 else seed,
    )
    return InfillJob(f"infill-{uuid.uuid4().hex}", ids, params, fields)


@dataclass
class InfillReply:
    """What the request has produced, and llama.cpp's limits on it: `n_indent` (a new line
    indented less than that ends the output, cut before its text) and `t_max_predict_ms` (past
    that time, a new line ends it)."""

    job: InfillJob
    model: str
    tokenizer: Tokenizer
    text: str = ""
    num_tokens: int = 0
    stop_type: str = "none"
    cached: int = 0
    drafted: tuple[int, int] = (0, 0)  # draft tokens, accepted ones
    start: float = field(default_factory=time.monotonic)
    first: float | None = None  # when the first token came: the prompt's time ends there
    end: float | None = None

    def add(self, delta: Delta) -> bool:
        """Take a delta; True once the output is complete (the engine's finish or a limit)."""
        now = time.monotonic()
        self.first = self.first or now
        self.num_tokens += len(delta.token_ids)
        old, self.text = len(self.text), self.text + delta.text
        if delta.usage is not None:
            self.cached = delta.usage.cached_tokens
            self.drafted = delta.usage.draft_tokens, delta.usage.accepted_tokens
        if self._limited(old, now):
            self.stop_type = "limit"
        elif delta.finish_reason is not None:
            self.stop_type = self._stop_type(delta)
        else:
            return False
        self.end = now
        return True

    def _stop_type(self, delta: Delta) -> str:
        if delta.finish_reason == FinishReason.LENGTH:
            return "limit"
        if delta.finish_reason != FinishReason.STOP:
            return "none"
        ends = {self.tokenizer.eos_token_id, *self.job.params.stop_token_ids}
        return "eos" if delta.token_ids[-1:] and delta.token_ids[-1] in ends else "word"

    def _limited(self, old: int, now: float) -> bool:
        """Whether n_indent or t_max_predict_ms ends the output at the text added after
        `old` (the text is cut for n_indent)."""
        n_indent = self.job.fields.get("n_indent", 0)
        cut = indent_cut(self.text, n_indent, max(self.text.rfind("\n", 0, old), 0))
        if cut is not None:
            self.text = self.text[:cut]
            return True
        budget = self.job.fields.get("t_max_predict_ms", -1)
        late = budget > 0 and (now - (self.first or now)) * 1000 > budget
        return late and "\n" in self.text[old:]

    def chunk(self, content: str, tokens: list[int] | None = None) -> JSON:
        """A streamed partial result (its tokens' ids)."""
        return {
            "index": 0,
            "content": content,
            "tokens": tokens or [],
            "stop": False,
            "id_slot": -1,
            "tokens_predicted": self.num_tokens,
            "tokens_evaluated": len(self.job.prompt_ids),
        }

    def full(self, streamed: bool = False) -> JSON:
        """The final result (its content already streamed, or whole), cut to
        `response_fields` where the request names them."""
        predicted = self.num_tokens
        body = self.chunk("" if streamed else self.text) | {
            "stop": True,
            "id_slot": 0,
            "model": self.model,
            "tokens_predicted": predicted,
            "prompt": self.tokenizer.decode(self.job.prompt_ids, skip_special_tokens=False),
            "has_new_line": "\n" in self.text,
            "truncated": False,
            "stop_type": self.stop_type,
            "stopping_word": "",
            "tokens_cached": len(self.job.prompt_ids) + predicted,
            "generation_settings": self.settings(),
            "timings": self.timings(predicted),
        }
        paths = self.job.fields.get("response_fields")
        return nested_values(paths, body) if paths else body

    def settings(self) -> JSON:
        p = self.job.params
        return {
            "n_predict": self.job.fields.get("n_predict", -1),
            "temperature": p.temperature,
            "top_k": p.top_k,
            "top_p": p.top_p,
            "min_p": p.min_p,
            "stop": list(p.stop),
            "n_indent": self.job.fields.get("n_indent", 0),
            "t_max_predict_ms": self.job.fields.get("t_max_predict_ms", -1),
        }

    def timings(self, predicted: int) -> JSON:
        """llama.cpp's timings: prompt_n counts the prompt tokens computed (not cached)."""
        first = self.first or time.monotonic()
        prompt_ms = (first - self.start) * 1000
        predicted_ms = ((self.end or first) - first) * 1000
        prompt_n = len(self.job.prompt_ids) - self.cached
        body = {
            "cache_n": self.cached,
            "prompt_n": prompt_n,
            "prompt_ms": prompt_ms,
            "prompt_per_token_ms": prompt_ms / max(prompt_n, 1),
            "prompt_per_second": prompt_n / max(prompt_ms / 1000, 1e-9),
            "predicted_n": predicted,
            "predicted_ms": predicted_ms,
            "predicted_per_token_ms": predicted_ms / max(predicted, 1),
            "predicted_per_second": predicted / max(predicted_ms / 1000, 1e-9),
        }
        if self.drafted[0]:
            body |= {"draft_n": self.drafted[0], "draft_n_accepted": self.drafted[1]}
        return body


def indent_cut(text: str, n_indent: int, start: int = 0) -> int | None:
    """Where llama.cpp's n_indent ends the text: at the first character (a new line too) of
    a line (after a new line at or past `start`) whose indentation is less than n_indent;
    None if none."""
    if n_indent <= 0:
        return None
    newline = text.find("\n", start)
    while newline >= 0:
        line = newline + 1
        body = len(text[line:]) - len(text[line:].lstrip(" \t"))
        if line + body < len(text) and body < n_indent:  # an empty line too, as llama.cpp
            return line + body
        newline = text.find("\n", line)
    return None


def nested_values(paths: list[str], body: JSON) -> JSON:
    """llama.cpp's response_fields: {path: value} for each path (a/b: body[a][b]) found."""
    found = {}
    for path in paths:
        value: Any = body
        for key in path.split("/"):
            value = value.get(key) if isinstance(value, dict) else None
        if value is not None:
            found[path] = value
    return found


# ---------------------------------------------------------------------------------------------
# Serving


async def respond(
    request: web.Request, engine: Engine, job: InfillJob, model: str
) -> web.StreamResponse:
    """Run the job; a request left unfinished in any way is aborted at once."""
    reply = InfillReply(job, model, engine.tokenizer)
    deltas = engine.submit(job.prompt_ids, job.params, job.request_id)
    try:
        if job.fields.get("stream", False):
            return await stream_out(request, deltas, reply)
        async for delta in deltas:
            if delta.error is not None:
                raise ApiError(500, delta.error, "server_error")
            if reply.add(delta):
                break
        return web.json_response(reply.full())
    finally:
        if reply.end is None or reply.stop_type == "limit":  # unfinished, or cut by a limit
            engine.abort(job.request_id)


async def stream_out(
    request: web.Request, deltas: AsyncIterable[Delta], reply: InfillReply
) -> web.StreamResponse:
    """llama.cpp's stream: `data: {partial}` events, then the final result with no content
    (no [DONE])."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        async for delta in deltas:
            if delta.error is not None:
                await response.write(event(ApiError(500, delta.error, "server_error").body))
                break
            sent = len(reply.text)
            done = reply.add(delta)
            if reply.text[sent:]:
                await response.write(event(reply.chunk(reply.text[sent:], delta.token_ids)))
            if done:
                await response.write(event(reply.full(streamed=True)))
                break
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; respond() aborts the request
    return response


def event(body: JSON) -> bytes:
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"
