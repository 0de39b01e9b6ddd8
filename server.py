"""OpenAI-compatible HTTP server: completions and chat (SSE streaming), models, health, metrics.

`python server.py` serves the built-in demo with the default drafter on 127.0.0.1:8000;
`python server.py --help` lists the flags. Every request is checked by api.py, in one
table-driven pass, before it reaches the engine; what the engine still refuses (InvalidRequest,
Overloaded) is answered in the same OpenAI error shape.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import hmac
import importlib.util
import ipaddress
import json
import logging
import signal
import sys
import time
from collections.abc import AsyncIterable, Awaitable, Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import uvloop
from aiohttp import web

import infill
import page
from api import (
    JSON,
    ApiError,
    ChatReply,
    CompletionReply,
    Engine,
    Reply,
    chat_prompt,
    check_json,
    check_model,
    completion_prompt,
    make_job,
    rest_of_context,
    sampling_params,
    validate,
)
from core.params import InvalidRequest
from core.request import Delta, EngineFailed, Overloaded
from engine.config import (
    MODELLESS,
    EngineConfig,
    KVConfig,
    ReplicasConfig,
    SpecConfig,
    add_options,
    from_options,
    option,
)

log = logging.getLogger("tandem.server")


@dataclass(frozen=True)
class ServerOptions:
    # loopback unless asked: the demo has no business on a network
    host: str = option("127.0.0.1", "address to listen on")
    port: int = option(8000, "port to listen on; 0: a free one")
    api_key: str | None = option(
        None, "require `Authorization: Bearer KEY` on all but /health", metavar="KEY"
    )
    served_model_name: str | None = option(
        None, "the model's name in the API; default: its own", metavar="NAME"
    )
    # a full-context chat is far smaller
    max_body_bytes: int = option(1 << 20, "largest request body; past it: 413", metavar="BYTES")
    retry_after_s: int = option(
        1, "what a 503 asks the client to wait", flag="--retry-after-seconds", metavar="S"
    )
    # streams end at once on shutdown (engine.stop aborts them)
    shutdown_timeout_s: float = option(
        5.0, "how long shutdown waits for connections", flag="--shutdown-seconds", metavar="S"
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        "browser origins (https://example.com) allowed to call the API; others get 403",
        metavar="ORIGIN",
        many=True,
    )
    read_timeout_s: float = option(
        15.0,
        "the time a request's headers, then its body, have to arrive",
        flag="--read-timeout-seconds",
        metavar="S",
    )
    # its own flags: engine replicas on Ray Serve behind this server (engine/replicas.py)
    cluster: ReplicasConfig = dataclasses.field(default_factory=ReplicasConfig)

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.api_key == "":
            raise ValueError("api key must not be empty")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be at least 1024")
        if self.read_timeout_s <= 0:
            raise ValueError("read_timeout_s must be > 0")

    @property
    def loopback(self) -> bool:
        """Bound to this machine only: then a Host naming another host is a DNS rebinding."""
        return _is_loopback(self.host)


def _is_loopback(host: str) -> bool:
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


# ---------------------------------------------------------------------------------------------
# Errors


def error_response(e: ApiError) -> web.Response:
    """An ApiError as aiohttp's response: its status, OpenAI's error body, its headers."""
    return web.json_response(e.body, status=e.status, headers=e.headers)


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
        return error_response(e)
    except InvalidRequest as e:
        return error_response(ApiError(400, str(e)))
    except EngineFailed as e:
        failed = ApiError(503, f"the engine has stopped serving: {e}", "server_error", "failed")
        return error_response(failed)
    except Overloaded as e:
        retry = str(request.app[OPTIONS].retry_after_s)
        message = str(e) or "the server is overloaded; retry later"
        overloaded = ApiError(
            503, message, "server_overloaded", "server_overloaded", headers={"Retry-After": retry}
        )
        return error_response(overloaded)
    except web.HTTPException as e:
        if e.status < 400:
            raise
        return error_response(http_error(e))
    except Exception:
        log.exception("error serving %s %s", request.method, request.path)
        return error_response(ApiError(500, "internal server error", "server_error"))


def auth(api_key: str) -> Callable[..., Awaitable[Any]]:
    expected = api_key.encode()

    @web.middleware
    async def check(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
        scheme, _, given = request.headers.get("Authorization", "").strip().partition(" ")
        # the scheme is case-insensitive (RFC 9110); the key is compared in constant time, so
        # that the comparison does not tell how much of it was right
        good = scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), expected)
        public = request.path == "/health" or page.is_public(request)
        if not public and request.method != "OPTIONS" and not good:
            raise ApiError(
                401,
                "invalid or missing API key",
                "authentication_error",
                "invalid_api_key",
                headers={"WWW-Authenticate": 'Bearer realm="tandem"'},
            )
        return await handler(request)

    return check


@web.middleware
async def headers(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
    """Headers that are not UTF-8 text are refused (aiohttp hands their bytes on as lone
    surrogates, which nothing after this point could encode)."""
    for name, value in request.headers.items():
        try:
            value.encode()
        except UnicodeEncodeError:
            raise ApiError(400, f"the {name!r} header is not UTF-8 text") from None
    return await handler(request)


def browser_guard(options: ServerOptions) -> Callable[..., Awaitable[Any]]:
    """What a local server owes the browser on the same machine: a page of another origin may
    not call it (403 unless --allowed-origins names it; those get CORS answers), and, bound to
    loopback, a Host naming another host (DNS rebinding) is refused."""
    allowed = set(options.allowed_origins)

    @web.middleware
    async def guard(request: web.Request, handler: Callable[..., Awaitable[Any]]) -> Any:
        # the outermost middleware: its refusals are answered here, and the CORS headers go on
        # every answer to an allowed origin, errors included
        if options.loopback and not _is_loopback(_host_name(request.host)):
            host = ApiError(403, f"the Host {request.host!r} is not this server", code="bad_host")
            return error_response(host)
        origin = request.headers.get("Origin")
        if origin is None or page.is_same_origin(request, origin):
            return await handler(request)
        if origin not in allowed:
            refused = ApiError(403, f"the origin {origin!r} is not allowed", code="bad_origin")
            return error_response(refused)
        cors = {"Access-Control-Allow-Origin": origin, "Vary": "Origin"}
        if request.method == "OPTIONS":  # a preflight
            return web.Response(status=204, headers=cors | PREFLIGHT)
        response = await handler(request)
        response.headers.update(cors)
        return response

    return guard


PREFLIGHT = {
    "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
    "Access-Control-Allow-Headers": "Authorization, Content-Type",
    "Access-Control-Max-Age": "600",
}


def _host_name(host: str) -> str:
    """The name in a Host header, without its port ([::1]:8000 -> ::1)."""
    if host.startswith("["):
        return host[1 : host.find("]")]
    return host.rpartition(":")[0] if host.count(":") == 1 else host


# ---------------------------------------------------------------------------------------------
# Routes

ENGINE = web.AppKey("engine", Engine)
OPTIONS = web.AppKey("options", ServerOptions)
MODEL = web.AppKey("model", str)
LARGE_BODIES = web.AppKey("large_bodies", asyncio.Semaphore)
SMALL_BODY_BYTES = 64 << 10  # a chat of a few thousand tokens
LARGE_BODY_RATE = 32 << 20  # bytes/s: a 1 MiB body a 30 ms, while streams keep their pace


T = TypeVar("T")


async def off_loop(fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) on a worker thread: parsing, tokenizing and templating a large body must not
    hold up the event loop that streams every other request's tokens."""
    return await asyncio.get_running_loop().run_in_executor(None, partial(fn, *args))


async def read_body(request: web.Request) -> Any:
    if request.content_type != "application/json":
        raise ApiError(415, "the request body must be application/json", code="bad_content_type")
    if request.content_length is not None and request.content_length <= SMALL_BODY_BYTES:
        return await off_loop(parse_json, await read_bytes(request))
    # Large bodies go through one lane, one at a time and at LARGE_BODY_RATE at most (refused
    # ones too): a flood of them then waits in the sockets (TCP backpressure) instead of taking
    # the event loop, a core and the GIL from the streams that run (docs/performance.md: One-off
    # studies).
    async with request.app[LARGE_BODIES]:
        start, raw = time.monotonic(), b""
        try:
            raw = await read_bytes(request)
            return await off_loop(parse_json, raw)
        finally:
            await asyncio.sleep(len(raw) / LARGE_BODY_RATE - (time.monotonic() - start))


async def read_bytes(request: web.Request) -> bytes:
    try:
        async with asyncio.timeout(request.app[OPTIONS].read_timeout_s):
            return await request.read()  # past client_max_size: a 413
    except TimeoutError:
        raise ApiError(408, "the request body did not arrive in time", code="timeout") from None


def parse_json(raw: bytes) -> Any:
    try:
        body = json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body nests too deeply") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    check_json(body)
    return body


def sse(body: JSON) -> bytes:
    """One server-sent event."""
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


async def completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    fields = validate(await read_body(request), request.path, "prompt")
    check_model(fields, request.app[MODEL])
    prompt_ids = await off_loop(completion_prompt, fields["prompt"], engine, fields.get("suffix"))
    params = sampling_params(fields, fields.get("max_tokens", 16), fields.get("logprobs"), engine)
    job = make_job("cmpl", prompt_ids, params, fields, engine)
    if params.grammar is not None:  # on a worker thread, within a time limit (else a 400)
        await engine.compile_grammar(params.grammar)
    return await respond(request, CompletionReply(job, request.app[MODEL], engine.tokenizer))


async def chat_completions(request: web.Request) -> web.StreamResponse:
    engine = request.app[ENGINE]
    fields = validate(await read_body(request), request.path, "messages")
    check_model(fields, request.app[MODEL])
    if "top_logprobs" in fields and not fields.get("logprobs"):
        raise ApiError(400, "'top_logprobs' needs 'logprobs' set to true")
    prompt_ids = await off_loop(chat_prompt, fields["messages"], engine, fields.get("tools"))
    max_tokens = fields.get("max_completion_tokens", fields.get("max_tokens"))
    if max_tokens is None:
        max_tokens = rest_of_context(len(prompt_ids), engine.max_model_len)
    logprobs = fields.get("top_logprobs", 0) if fields.get("logprobs") else None
    params = sampling_params(fields, max_tokens, logprobs, engine)
    job = make_job("chatcmpl", prompt_ids, params, fields, engine)
    if params.grammar is not None:
        await engine.compile_grammar(params.grammar)
    return await respond(request, ChatReply(job, request.app[MODEL], engine.tokenizer))


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
            raise ApiError(503 if reply.unavailable else 500, reply.error, "server_error")
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


async def infill_completion(request: web.Request) -> web.StreamResponse:
    """llama.cpp's /infill (infill.py), for editor plugins."""
    engine, model = request.app[ENGINE], request.app[MODEL]
    fields = infill.validate(await read_body(request))
    job = await off_loop(infill.make_job, fields, engine, model)
    return await infill.respond(request, engine, job, model)


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
    failure = request.app[ENGINE].failure
    if failure is not None:
        return web.json_response({"status": "failed", "cause": failure}, status=503)
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    text = request.app[ENGINE].metrics.render()
    return web.Response(
        body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"}
    )


def make_app(engine: Engine, options: ServerOptions) -> web.Application:
    middlewares = [browser_guard(options), errors, headers]
    middlewares += [auth(options.api_key)] if options.api_key else []
    app = web.Application(client_max_size=options.max_body_bytes, middlewares=middlewares)
    app[ENGINE] = engine
    app[OPTIONS] = options
    app[MODEL] = options.served_model_name or engine.model_name
    app[LARGE_BODIES] = asyncio.Semaphore(1)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/infill", infill_completion)
    page.add_routes(app, app[MODEL], options.api_key is not None)
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
        # a connection that has not sent a whole request's headers in time is closed
        keepalive_timeout=options.read_timeout_s,
    )
    await runner.setup()
    await web.TCPSite(runner, options.host, options.port).start()
    return runner


async def serve(engine: Engine, options: ServerOptions) -> int:
    """Serve until SIGTERM or SIGINT, or until the engine fails; then stop accepting, abort
    what runs, and return the exit status (1 when the engine failed: a supervisor restarts)."""
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
        waits = [asyncio.ensure_future(e.wait()) for e in (stopping, engine.failed)]
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        for wait in waits:
            wait.cancel()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        for site in list(runner.sites):
            await site.stop()  # no new connections
        if engine.failure is None:  # a hung engine's device thread may never stop
            await engine.stop()  # what runs ends now: open streams finish with "abort"
        await runner.cleanup()
    if engine.failure is not None:
        log.error("exiting: the engine stopped serving: %s", engine.failure)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# Command line


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="server.py",
        description="Serve a model with speculative decoding over an OpenAI-compatible API.",
    )
    add_options(parser, EngineConfig, "engine")
    add_options(parser, SpecConfig, "speculative decoding")
    add_options(parser, KVConfig, "KV cache")
    add_options(parser, ServerOptions, "server")
    add_options(parser, ReplicasConfig, "replicas (Ray Serve)")
    return parser


def config_from_args(argv: Sequence[str] | None = None) -> tuple[EngineConfig, ServerOptions]:
    """Flags -> the engine's and the server's configuration; a bad value exits with usage."""
    parser = build_parser()
    parsed = parser.parse_args(argv)
    try:
        spec, kv = from_options(SpecConfig, parsed), from_options(KVConfig, parsed)
        config = from_options(EngineConfig, parsed, spec=spec, kv=kv)
        options = from_options(ServerOptions, parsed, cluster=from_options(ReplicasConfig, parsed))
    except ValueError as e:
        parser.error(str(e))
    if options.cluster.replicas and config.tensor_parallel_size > 1:
        parser.error("--replicas with --tensor-parallel-size: each replica is one process")
    if options.cluster.replicas and importlib.util.find_spec("ray") is None:
        parser.error("--replicas runs on Ray Serve: install the extra, pip install -e '.[cluster]'")
    if config.spec.draft is not None and config.spec.method in MODELLESS:
        parser.error(f"--draft is not used with --speculative {config.spec.method}")
    if config.device.startswith("cuda") and not _cuda_available():
        parser.error(f"--device {config.device}: this machine has no CUDA device")
    return config, options


def _cuda_available() -> bool:
    import torch  # only where a CUDA device is asked for: --help stays quick

    return torch.cuda.is_available()


def main(argv: Sequence[str] | None = None) -> int:
    config, options = config_from_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    from engine import parallel  # torch and the models: only once the flags are good
    from engine.engine import AsyncEngine
    from engine.worker import leave, serve_rank, start_leader

    size, workers, replicas = config.tensor_parallel_size, None, None
    engine: Engine
    try:
        if size > 1 and (joined := parallel.from_environment(size)) is not None:
            rank, address = joined  # torchrun started every rank; it watches them
            group = parallel.join(rank, size, address)
            if rank > 0:
                serve_rank(config, group, lambda: None)
                return 0
            engine = AsyncEngine(config, group)
        elif size > 1:
            engine, workers = start_leader(config)
        elif options.cluster.replicas:
            from engine.replicas import Replicas  # Ray: only where replicas are asked for

            engine = replicas = Replicas(config, options.cluster, options.shutdown_timeout_s)
        else:
            engine = AsyncEngine(config)
    except (OSError, ValueError, RuntimeError) as e:
        print(f"server.py: error: cannot start the engine: {e}", file=sys.stderr)
        return 1
    # what the start made lives as long as the process: out of the garbage collector's sight,
    # whose full collections would traverse it all (SmolLM2's server holds 220,000 objects
    # after its start, a full collection over them 90 ms, a step's host work stalled as long)
    gc.freeze()
    try:
        return uvloop.run(serve(engine, options))
    finally:
        if workers is not None:
            leave(workers)
        if replicas is not None:  # the Serve application goes, even after a failure
            replicas.close()


if __name__ == "__main__":
    sys.exit(main())
