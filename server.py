"""OpenAI-compatible HTTP server: completions and chat (SSE streaming), models, health, metrics.

`python server.py` serves the built-in demo with the default drafter on 127.0.0.1:8000;
`python server.py --help` lists the flags. Every request is checked here, in one table-driven
pass, before it reaches the engine; what the engine still refuses (InvalidRequest, Overloaded)
is answered in the same OpenAI error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import json
import logging
import math
import signal
import sys
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeGuard

import uvloop
from aiohttp import web

from engine.config import SPECULATIVE_METHODS, EngineConfig, KVConfig, SpecConfig
from engine.request import (
    Delta,
    FinishReason,
    InvalidRequest,
    Overloaded,
    SamplingParams,
    TokenLogprob,
    Usage,
)

JSON = dict[str, Any]
log = logging.getLogger("tandem.server")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...
    def decode(self, ids: list[int]) -> str: ...
    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True
    ) -> str: ...


class Metrics(Protocol):
    def render(self) -> str: ...


class Engine(Protocol):
    """What the server needs of engine.engine.AsyncEngine (tests pass a fake)."""

    @property
    def model_name(self) -> str: ...
    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def max_model_len(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def metrics(self) -> Metrics: ...
    async def start(self) -> None: ...
    async def stop(self) -> None: ...
    def submit(
        self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None
    ) -> AsyncIterable[Delta]: ...
    def abort(self, request_id: str) -> None: ...


@dataclass(frozen=True)
class ServerOptions:
    host: str = "127.0.0.1"  # loopback unless asked: the demo has no business on a network
    port: int = 8000
    api_key: str | None = None  # when set, every route but /health needs `Bearer KEY`
    served_model_name: str | None = None  # None: the engine's model_name
    max_body_bytes: int = 1 << 20  # a full-context chat is far smaller; past it: 413
    retry_after_s: int = 1  # what a 503 asks the client to wait
    shutdown_timeout_s: float = 5.0  # streams end at once on shutdown (engine.stop aborts them)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.api_key == "":
            raise ValueError("api key must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")


# ---------------------------------------------------------------------------------------------
# Errors


class ApiError(Exception):
    """A refusal, answered with an HTTP status and OpenAI's error body
    `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        code: str | None = None,
        param: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.type, self.code = status, message, type, code
        self.param, self.headers = param, headers

    @property
    def body(self) -> JSON:
        error = {"message": self.message, "type": self.type, "param": self.param}
        return {"error": error | {"code": self.code}}

    def response(self) -> web.Response:
        return web.json_response(self.body, status=self.status, headers=self.headers)


def http_error(e: web.HTTPException) -> ApiError:
    """aiohttp's own refusals (unknown route, wrong method, body too large) in that shape."""
    codes = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}
    return ApiError(e.status, e.text or e.reason, code=codes.get(e.status))


@web.middleware
async def errors(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
    """Every refusal leaves in the OpenAI error shape, and the server goes on serving."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except InvalidRequest as e:
        return ApiError(400, str(e)).response()
    except Overloaded as e:
        retry = str(request.app[OPTIONS].retry_after_s)
        message = str(e) or "the server is overloaded; retry later"
        return ApiError(
            503, message, "server_overloaded", "server_overloaded", headers={"Retry-After": retry}
        ).response()
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return http_error(e).response()
    except Exception:
        log.exception("error serving %s %s", request.method, request.path)
        return ApiError(500, "internal server error", "server_error").response()


def auth(api_key: str) -> Callable[..., Awaitable[Any]]:
    expected = f"Bearer {api_key}".encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
        given = request.headers.get("Authorization", "").encode()
        # constant time: the comparison does not tell how much of the key was right
        if request.path != "/health" and not hmac.compare_digest(given, expected):
            raise ApiError(
                401, "invalid or missing API key", "authentication_error", "invalid_api_key"
            )
        return await handler(request)

    return check


# ---------------------------------------------------------------------------------------------
# Validation: one table per route, checked in one pass. null counts as absent, as in OpenAI's API.

Check = Callable[[Any], bool]


def _int(v: Any) -> bool:
    return type(v) is int  # bool is an int to Python, not to JSON


def _number(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _str(v: Any) -> bool:
    return type(v) is str


def _ids(v: Any) -> TypeGuard[list[int]]:
    return type(v) is list and all(_int(t) for t in v)


def _stop(v: Any) -> bool:
    return _str(v) or (type(v) is list and len(v) <= 16 and all(_str(s) for s in v))


def _stream_options(v: Any) -> bool:
    keys = ("include_usage", "continuous_usage_stats")
    return type(v) is dict and all(k in keys and _bool(x) for k, x in v.items())


def _message(m: Any) -> bool:
    roles = ("system", "user", "assistant")
    return type(m) is dict and m.get("role") in roles and _str(m.get("content"))


def _messages(v: Any) -> bool:
    return type(v) is list and len(v) > 0 and all(_message(m) for m in v)


def _in(lo: int, hi: int) -> Check:
    return lambda v: _int(v) and lo <= v <= hi


def _is(value: Any) -> Check:
    return lambda v: v == value and type(v) is type(value)


# name: (check, what the value must be)
COMMON_FIELDS: dict[str, tuple[Check, str]] = {
    "model": (_str, "a string"),
    "stream": (_bool, "a boolean"),
    "stream_options": (
        _stream_options,
        "an object of booleans: include_usage, continuous_usage_stats",
    ),
    "max_tokens": (_int, "an integer"),
    "temperature": (_number, "a number"),
    "top_p": (_number, "a number"),
    "top_k": (_int, "an integer"),
    "min_p": (_number, "a number"),
    "presence_penalty": (_number, "a number"),
    "frequency_penalty": (_number, "a number"),
    "repetition_penalty": (_number, "a number"),
    "seed": (lambda v: _int(v) and 0 <= v < 2**63, "an integer in [0, 2^63)"),
    "stop": (_stop, "a string or a list of at most 16 strings"),
    "stop_token_ids": (_ids, "a list of token ids"),
    "ignore_eos": (_bool, "a boolean"),
    "num_speculative_tokens": (_int, "an integer"),
    "n": (_is(1), "1 (one choice per request is supported)"),
}
COMPLETION_FIELDS = COMMON_FIELDS | {
    "prompt": (lambda v: _str(v) or type(v) is list, "a string or a list of token ids"),
    "logprobs": (_in(0, 5), "an integer in 0..5"),
    "echo": (_is(False), "false (echo is not supported)"),
    "best_of": (_is(1), "1 (best_of is not supported)"),
    "suffix": (lambda v: False, "null (suffix is not supported)"),
}
CHAT_FIELDS = COMMON_FIELDS | {
    "messages": (_messages, "a non-empty list of {role, content} with string content"),
    "logprobs": (_bool, "a boolean"),
    "top_logprobs": (_in(0, 20), "an integer in 0..20"),
    "max_completion_tokens": (_int, "an integer"),
    "tools": (lambda v: v == [], "empty (tools are not supported)"),
}
# fields that SamplingParams takes as they are (it checks their ranges itself)
PASSED_THROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
    "ignore_eos",
    "num_speculative_tokens",
)


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def validate(body: Any, table: dict[str, tuple[Check, str]], required: str) -> JSON:
    """The body's known fields that are not null, each checked against `table`."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get(required) is None:
        raise ApiError(400, f"'{required}' is required", param=required)
    fields = {}
    for name, (check, what) in table.items():
        value = body.get(name)
        if value is None:
            continue
        if not check(value):
            raise ApiError(400, f"'{name}' must be {what}, got {_short(value)}", param=name)
        fields[name] = value
    if "stream_options" in fields and not fields.get("stream"):
        raise ApiError(400, "'stream_options' is only allowed when 'stream' is true")
    return fields


def check_model(fields: JSON, served: str) -> None:
    model = fields.get("model")
    if model is not None and model != served:
        raise ApiError(
            404, f"the model '{model}' does not exist", code="model_not_found", param="model"
        )


def check_ids(ids: list[int], vocab_size: int, what: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ApiError(
            400, f"{what} holds token id {bad}, outside the vocabulary [0, {vocab_size})"
        )


def check_context(prompt_len: int, max_tokens: int, max_model_len: int) -> None:
    if prompt_len + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has "
            f"{prompt_len} and max_tokens asks for {max_tokens}",
            code="context_length_exceeded",
        )


def completion_prompt(value: str | list[Any], engine: Engine) -> list[int]:
    """A string, a list of token ids, or a list holding exactly one of those: its ids."""
    if value and type(value) is list and type(value[0]) in (str, list):
        if len(value) != 1:
            raise ApiError(400, f"only one prompt per request is supported, got {len(value)}")
        value = value[0]
    if not value:
        raise ApiError(400, "'prompt' must not be empty")
    if isinstance(value, str):
        return engine.tokenizer.encode(value, add_special_tokens=True)
    if not _ids(value):
        raise ApiError(400, "'prompt' must be a string or a list of token ids")
    check_ids(value, engine.vocab_size, "'prompt'")
    return value


def chat_prompt(messages: list[dict[str, Any]], engine: Engine) -> list[int]:
    try:
        text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as e:  # no template, or the template refused the conversation
        raise ApiError(400, str(e)) from e
    # the template writes the BOS itself
    return engine.tokenizer.encode(text, add_special_tokens=False)


def sampling_params(
    fields: JSON, max_tokens: int, logprobs: int | None, engine: Engine
) -> SamplingParams:
    """SamplingParams from checked fields; its own range checks raise InvalidRequest (a 400)."""
    stop = fields.get("stop", ())
    stop_ids = fields.get("stop_token_ids", [])
    check_ids(stop_ids, engine.vocab_size, "'stop_token_ids'")
    return SamplingParams(
        max_tokens=max_tokens,
        stop=(stop,) if isinstance(stop, str) else tuple(stop),
        stop_token_ids=tuple(stop_ids),
        logprobs=logprobs,
        **{name: fields[name] for name in PASSED_THROUGH if name in fields},
    )


# ---------------------------------------------------------------------------------------------
# Replies: what a request has produced, in OpenAI's shapes


@dataclass
class Job:
    """A checked request, ready for the engine."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: bool
    include_usage: bool  # stream_options.include_usage: a last chunk with the usage
    continuous_usage: bool  # stream_options.continuous_usage_stats: usage on every chunk


def usage_body(u: Usage) -> JSON:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "speculative": {
            "draft_tokens": u.draft_tokens,
            "accepted_tokens": u.accepted_tokens,
            "steps": u.spec_steps,
        },
    }


class Reply(ABC):
    """A request's output so far; subclasses give the completions and the chat shapes."""

    object_full = ""
    object_chunk = ""

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer):
        self.job, self.model, self.tokenizer = job, model, tokenizer
        self.created = int(time.time())
        self.text: list[str] = []
        self.logprobs: list[TokenLogprob] = []
        self.num_tokens = 0
        self.finish: FinishReason | None = None
        self.error: str | None = None
        self.final_usage: Usage | None = None

    def add(self, delta: Delta) -> None:
        self.text.append(delta.text)
        self.logprobs.extend(delta.logprobs or [])
        self.num_tokens += len(delta.token_ids)
        self.finish = delta.finish_reason or self.finish
        self.error = delta.error or self.error
        self.final_usage = delta.usage or self.final_usage

    @property
    def usage(self) -> Usage:
        counted = Usage(len(self.job.prompt_ids), self.num_tokens)
        return self.final_usage or counted

    def envelope(self, obj: str, choices: list[JSON]) -> JSON:
        return {
            "id": self.job.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, delta: Delta) -> JSON:
        finish = delta.finish_reason.value if delta.finish_reason else None
        body = self.envelope(self.object_chunk, [self.chunk_choice(delta, finish)])
        if self.job.continuous_usage:
            body["usage"] = usage_body(self.usage)
        return body

    def usage_chunk(self) -> JSON:
        return self.envelope(self.object_chunk, []) | {"usage": usage_body(self.usage)}

    def full(self) -> JSON:
        finish = self.finish.value if self.finish else None
        return self.envelope(self.object_full, [self.full_choice(finish)]) | {
            "usage": usage_body(self.usage)
        }

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def opening(self) -> list[JSON]:
        return []

    @abstractmethod
    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        """The choice of a streamed chunk that carries `delta`."""

    @abstractmethod
    def full_choice(self, finish: str | None) -> JSON:
        """The choice of the whole, non-streamed response."""


class CompletionReply(Reply):
    object_full = "text_completion"
    object_chunk = "text_completion"

    def __init__(self, job: Job, model: str, tokenizer: Tokenizer):
        super().__init__(job, model, tokenizer)
        self.text_offset = 0  # of the next token's text in the completion

    def logprobs_body(self, lps: list[TokenLogprob] | None) -> JSON | None:
        """OpenAI's completions form; text_offset counts from the start of the completion."""
        if lps is None or self.job.params.logprobs is None:
            return None
        tokens = [self.token_text(lp.token_id) for lp in lps]
        offsets = []
        for token in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(token)
        return {
            "tokens": tokens,
            "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{self.token_text(t): v for t, v in lp.top} for lp in lps],
            "text_offset": offsets,
        }

    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        logprobs = self.logprobs_body(delta.logprobs or [])
        return {"index": 0, "text": delta.text, "logprobs": logprobs, "finish_reason": finish}

    def full_choice(self, finish: str | None) -> JSON:
        logprobs = self.logprobs_body(self.logprobs)
        return {
            "index": 0,
            "text": "".join(self.text),
            "logprobs": logprobs,
            "finish_reason": finish,
        }


class ChatReply(Reply):
    object_full = "chat.completion"
    object_chunk = "chat.completion.chunk"

    def logprob_entry(self, token_id: int, logprob: float) -> JSON:
        token = self.token_text(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

    def logprobs_body(self, lps: list[TokenLogprob]) -> JSON | None:
        """OpenAI's chat form: per token its entry and its top alternatives."""
        if self.job.params.logprobs is None:
            return None
        content = [
            self.logprob_entry(lp.token_id, lp.logprob)
            | {"top_logprobs": [self.logprob_entry(t, v) for t, v in lp.top]}
            for lp in lps
        ]
        return {"content": content}

    def opening(self) -> list[JSON]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
        return [self.envelope(self.object_chunk, [choice | {"logprobs": None}])]

    def chunk_choice(self, delta: Delta, finish: str | None) -> JSON:
        return {
            "index": 0,
            "delta": {"content": delta.text},
            "logprobs": self.logprobs_body(delta.logprobs or []),
            "finish_reason": finish,
        }

    def full_choice(self, finish: str | None) -> JSON:
        return {
            "index": 0,
            "message": {"role": "assistant", "content": "".join(self.text)},
            "logprobs": self.logprobs_body(self.logprobs),
            "finish_reason": finish,
        }


# ---------------------------------------------------------------------------------------------
# Routes

ENGINE = web.AppKey("engine", Engine)
OPTIONS = web.AppKey("options", ServerOptions)
MODEL = web.AppKey("model", str)


async def read_body(request: web.Request) -> Any:
    raw = await request.read()  # past client_max_size: HTTPRequestEntityTooLarge, a 413
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e


def sse(body: JSON) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    fields = validate(await read_body(request), COMPLETION_FIELDS, "prompt")
    check_model(fields, request.app[MODEL])
    prompt_ids = completion_prompt(fields["prompt"], engine)
    params = sampling_params(fields, fields.get("max_tokens", 16), fields.get("logprobs"), engine)
    job = make_job("cmpl", prompt_ids, params, fields, engine)
    return await respond(request, CompletionReply(job, request.app[MODEL], engine.tokenizer))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    fields = validate(await read_body(request), CHAT_FIELDS, "messages")
    check_model(fields, request.app[MODEL])
    if "top_logprobs" in fields and not fields.get("logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true")
    prompt_ids = chat_prompt(fields["messages"], engine)
    # as in OpenAI's API, a chat without a limit may use the rest of the context
    rest = max(engine.max_model_len - len(prompt_ids), 1)
    limit = fields.get("max_completion_tokens", fields.get("max_tokens"))
    max_tokens = rest if limit is None else limit
    logprobs = fields.get("top_logprobs", 0) if fields.get("logprobs") else None
    params = sampling_params(fields, max_tokens, logprobs, engine)
    job = make_job("chatcmpl", prompt_ids, params, fields, engine)
    return await respond(request, ChatReply(job, request.app[MODEL], engine.tokenizer))


def make_job(
    prefix: str, prompt_ids: list[int], params: SamplingParams, fields: JSON, engine: Engine
) -> Job:
    check_context(len(prompt_ids), params.max_tokens, engine.max_model_len)
    options = fields.get("stream_options", {})
    return Job(
        request_id=f"{prefix}-{uuid.uuid4().hex}",
        prompt_ids=prompt_ids,
        params=params,
        stream=fields.get("stream", False),
        include_usage=options.get("include_usage", False),
        continuous_usage=options.get("continuous_usage_stats", False),
    )


async def respond(request: web.Request, reply: Reply) -> web.StreamResponse:
    """Run the job on the engine; a request left unfinished in any way is aborted at once."""
    engine, job = request.app[ENGINE], reply.job
    deltas = engine.submit(job.prompt_ids, job.params, job.request_id)  # may refuse: 400, 503
    try:
        if job.stream:
            return await stream_out(request, deltas, reply)
        async for delta in deltas:
            reply.add(delta)
        if reply.error is not None:
            raise ApiError(500, reply.error, "server_error")
        return web.json_response(reply.full())
    finally:
        # a disconnect cancels the handler (or fails a write): free the pages now
        if reply.finish is None:
            engine.abort(job.request_id)


async def stream_out(
    request: web.Request, deltas: AsyncIterable[Delta], reply: Reply
) -> web.StreamResponse:
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    try:
        await response.prepare(request)
        for chunk in reply.opening():
            await response.write(sse(chunk))
        async for delta in deltas:
            reply.add(delta)
            if delta.error is not None:
                await response.write(sse(ApiError(500, delta.error, "server_error").body))
                break
            await response.write(sse(reply.chunk(delta)))
        if reply.job.include_usage:
            await response.write(sse(reply.usage_chunk()))
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
    except ConnectionResetError:
        pass  # the client left; respond() aborts the request
    return response


async def models(request: web.Request) -> web.Response:
    model = {
        "id": request.app[MODEL],
        "object": "model",
        "created": 0,
        "owned_by": "tandem",
        "max_model_len": request.app[ENGINE].max_model_len,
    }
    return web.json_response({"object": "list", "data": [model]})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    text = request.app[ENGINE].metrics.render()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def make_app(engine: Engine, options: ServerOptions) -> web.Application:
    middlewares = [errors] + ([auth(options.api_key)] if options.api_key else [])
    app = web.Application(client_max_size=options.max_body_bytes, middlewares=middlewares)
    app[ENGINE] = engine
    app[OPTIONS] = options
    app[MODEL] = options.served_model_name or engine.model_name
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    return app


async def start_server(engine: Engine, options: ServerOptions) -> web.AppRunner:
    """Serve on options.host:port (0: a free port, see runner.addresses); the caller has
    started the engine and cleans up with `runner.cleanup()`, then `engine.stop()`."""
    # handler_cancellation: a client that disconnects cancels its handler, which aborts
    runner = web.AppRunner(
        make_app(engine, options),
        handler_cancellation=True,
        shutdown_timeout=options.shutdown_timeout_s,
        access_log=None,
    )
    await runner.setup()
    await web.TCPSite(runner, options.host, options.port).start()
    return runner


async def serve(engine: Engine, options: ServerOptions) -> None:
    """Serve until SIGTERM or SIGINT; then stop accepting, abort what runs, and return."""
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stopping.set)
    await engine.start()
    runner = await start_server(engine, options)
    try:
        host, port = runner.addresses[0][:2]
        print(f"serving {runner.app[MODEL]} on http://{host}:{port}", flush=True)
        await stopping.wait()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for site in list(runner.sites):
            await site.stop()  # no new connections
        await engine.stop()  # what runs ends now: open streams finish with "abort"
        await runner.cleanup()


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    engine, spec, kv, server = EngineConfig(), SpecConfig(), KVConfig(), ServerOptions()
    # flag: (type, metavar, default, help); the defaults are the dataclasses' own
    flags: dict[str, tuple[type, str, Any, str]] = {
        "--model": (str, "DIR", None, "target model, a Hugging Face directory; default: the demo"),
        "--draft": (str, "DIR", None, "draft model, EAGLE or MTP head; default: the demo's"),
        "--num-speculative-tokens": (int, "K", spec.num_speculative_tokens, "draft tokens a step"),
        "--host": (str, "HOST", server.host, "address to listen on"),
        "--port": (int, "PORT", server.port, "port to listen on; 0: a free one"),
        "--api-key": (str, "KEY", None, "require `Authorization: Bearer KEY` on all but /health"),
        "--served-model-name": (str, "NAME", None, "the model's name in the API; default: its own"),
        "--trace-file": (str, "PATH", None, "write the step timeline to this file, as JSON lines"),
        "--max-running": (int, "N", engine.max_running, "requests decoding at once"),
        "--max-waiting": (int, "N", engine.max_waiting, "waiting requests; past them: 503"),
        "--max-model-len": (int, "N", engine.max_model_len, "context in tokens; 0: the model's"),
        "--page-size": (int, "N", kv.page_size, "tokens per KV page"),
        "--num-pages": (int, "N", kv.num_pages, "KV pages; 0: what the KV memory budget holds"),
        "--device": (str, "DEVICE", engine.device, "torch device: cpu, cuda, cuda:1, ..."),
        "--dtype": (str, "DTYPE", engine.dtype, "float32, bfloat16 or float16"),
        "--seed": (int, "N", engine.seed, "seed of the requests that bring none"),
    }
    parser = argparse.ArgumentParser(
        prog="server.py",
        description="Serve a model with speculative decoding over an OpenAI-compatible API.",
    )
    parser.add_argument(
        "--speculative",
        choices=SPECULATIVE_METHODS,
        default="draft",
        help="how draft tokens are proposed; none: no speculation (default: draft)",
    )
    for flag, (kind, metavar, default, text) in flags.items():
        shown = "" if default is None else f" (default: {default})"
        parser.add_argument(flag, type=kind, metavar=metavar, default=default, help=text + shown)
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> tuple[EngineConfig, ServerOptions]:
    """Flags -> the engine's and the server's configuration; a bad value exits with usage."""
    parser = build_parser()
    a = parser.parse_args(argv)
    if a.draft is not None and a.speculative in ("none", "ngram"):
        parser.error(f"--draft is not used with --speculative {a.speculative}")
    try:
        spec = SpecConfig(a.speculative, a.draft, a.num_speculative_tokens)
        kv = KVConfig(page_size=a.page_size, num_pages=a.num_pages)
        config = EngineConfig(
            model=a.model,
            spec=spec,
            kv=kv,
            device=a.device,
            dtype=a.dtype,
            max_running=a.max_running,
            max_waiting=a.max_waiting,
            max_model_len=a.max_model_len,
            trace_file=a.trace_file,
            seed=a.seed,
        )
        options = ServerOptions(a.host, a.port, a.api_key, a.served_model_name)
    except ValueError as e:
        parser.error(str(e))
    return config, options


def main(argv: Sequence[str] | None = None) -> int:
    config, options = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from engine.engine import AsyncEngine  # torch and the models: only once the flags are good

    try:
        engine = AsyncEngine(config)
    except (OSError, ValueError) as e:
        print(f"server.py: error: cannot load the model: {e}", file=sys.stderr)
        return 1
    uvloop.run(serve(engine, options))
    return 0


if __name__ == "__main__":
    sys.exit(main())
