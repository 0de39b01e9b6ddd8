"""Async Python client of the Tandem server (and of any OpenAI-compatible completions server).

async with TandemClient("http://127.0.0.1:8000") as client:
    reply = await client.complete("Once upon a time", max_tokens=32, temperature=0)
    async for chunk in await client.chat(messages, stream=True, max_tokens=32):
        print(chunk["choices"][0]["delta"].get("content", ""), end="")
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, Iterator
from types import TracebackType
from typing import Any, Literal, overload

import aiohttp

JSON = dict[str, Any]


class TandemError(Exception):
    """The server refused a request: its HTTP status and its OpenAI-shaped error."""

    def __init__(self, status: int, message: str, type: str | None = None, code: str | None = None):
        super().__init__(f"{status} {type or 'error'}: {message}")
        self.status, self.message, self.type, self.code = status, message, type, code


class TandemTimeout(TimeoutError):
    """No answer, or no next chunk of a stream, within the client's timeout."""


def _error(status: int, text: str) -> TandemError:
    """The server's error body ({"error": {...}}), or its raw text when it sent something else."""
    try:
        error = json.loads(text)["error"]
        return TandemError(status, error["message"], error.get("type"), error.get("code"))
    except (ValueError, KeyError, TypeError):
        return TandemError(status, text.strip() or "no message")


class TandemClient:
    """An aiohttp session to one server; use it as `async with TandemClient(url) as client`.

    `timeout` bounds connecting and each wait for data (a whole non-streamed answer, or the
    next chunk of a stream), not the length of a stream.
    """

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 60.0):
        self.base_url = base_url.rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> TandemClient:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout, sock_read=self.timeout)
        self._session = aiohttp.ClientSession(headers=headers, timeout=timeout)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("use TandemClient as `async with TandemClient(url) as client`")
        return self._session

    @overload
    async def complete(
        self, prompt: str | list[Any], stream: Literal[False] = False, **params: Any
    ) -> JSON: ...
    @overload
    async def complete(
        self, prompt: str | list[Any], stream: Literal[True], **params: Any
    ) -> AsyncGenerator[JSON, None]: ...
    async def complete(
        self, prompt: str | list[Any], stream: bool = False, **params: Any
    ) -> JSON | AsyncGenerator[JSON, None]:
        """POST /v1/completions: the response, or with stream=True an iterator of its chunks."""
        body = {"prompt": prompt, **params}
        if stream:
            return await self._stream("/v1/completions", body)
        return await self._request("POST", "/v1/completions", body)

    @overload
    async def chat(
        self, messages: list[dict[str, str]], stream: Literal[False] = False, **params: Any
    ) -> JSON: ...
    @overload
    async def chat(
        self, messages: list[dict[str, str]], stream: Literal[True], **params: Any
    ) -> AsyncGenerator[JSON, None]: ...
    async def chat(
        self, messages: list[dict[str, str]], stream: bool = False, **params: Any
    ) -> JSON | AsyncGenerator[JSON, None]:
        """POST /v1/chat/completions: as `complete`, for a conversation."""
        body = {"messages": messages, **params}
        if stream:
            return await self._stream("/v1/chat/completions", body)
        return await self._request("POST", "/v1/chat/completions", body)

    async def models(self) -> JSON:
        return await self._request("GET", "/v1/models")

    async def health(self) -> JSON:
        return await self._request("GET", "/health")

    async def metrics(self) -> str:
        """The Prometheus text of GET /metrics."""
        with self._timed():
            async with self.session.get(self.base_url + "/metrics") as response:
                text = await response.text()
                if response.status >= 400:
                    raise _error(response.status, text)
                return text

    async def _request(self, method: str, path: str, body: JSON | None = None) -> JSON:
        with self._timed():
            async with self.session.request(method, self.base_url + path, json=body) as response:
                text = await response.text()
                if response.status >= 400:
                    raise _error(response.status, text)
                return json.loads(text)

    async def _stream(self, path: str, body: JSON) -> AsyncGenerator[JSON, None]:
        """Send the request and check its status now; the chunks come from the iterator."""
        with self._timed():
            response = await self.session.post(self.base_url + path, json=body | {"stream": True})
            if response.status >= 400:
                text = await response.text()
                response.release()
                raise _error(response.status, text)
        return self._chunks(response)

    async def _chunks(self, response: aiohttp.ClientResponse) -> AsyncGenerator[JSON, None]:
        """Parsed `data:` lines up to `data: [DONE]`. Leaving the loop early closes the
        connection, which makes the server abort the request."""
        done = False
        try:
            with self._timed():
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, other SSE fields
                    data = line.removeprefix("data:").strip()
                    if data == "[DONE]":
                        done = True
                        return
                    chunk = json.loads(data)
                    if "error" in chunk:
                        raise _error(500, data)
                    yield chunk
            raise TandemError(response.status, "the stream ended without [DONE]")
        finally:
            if done:
                response.release()
            else:
                response.close()

    @contextlib.contextmanager
    def _timed(self) -> Iterator[None]:
        """aiohttp's timeouts (connect, or no data for `timeout` s) as a TandemTimeout."""
        try:
            yield
        except TimeoutError as e:
            raise TandemTimeout(f"no answer from the server within {self.timeout} s") from e
