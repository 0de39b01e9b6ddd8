"""A benchmark's server process: started on a free port, awaited until healthy, stopped."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.asynccontextmanager
async def serving(
    command: Sequence[str], log: Path, timeout: float
) -> AsyncIterator[tuple[str, subprocess.Popen]]:
    """Start the server (`command`, on a free port), yield its URL and process once /health
    answers 200, stop it on the way out. Its output goes to `log`."""
    port = free_port()
    command = [*command, "--port", str(port)]
    with open(log, "w") as out:
        process = subprocess.Popen(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        await wait_healthy(url, process, log, timeout)
        yield url, process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


async def wait_healthy(url: str, process: subprocess.Popen, log: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited ({process.returncode}); see {log}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(url + "/health") as response:
                    if response.status == 200:  # llama.cpp: 503 while it loads
                        return
            await asyncio.sleep(0.5)
    raise RuntimeError(f"the server was not healthy within {timeout:.0f} s; see {log}")
