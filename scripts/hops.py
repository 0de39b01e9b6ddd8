"""Count the hops of the request path: a streaming chat request on the demo's default server
(the draft model drafting), traced from the route to its last event.

A unit is a module, or a class in it. A hop is a distinct pair (caller's unit, callee's unit)
of our code, the two different: a call into another module or class, or a hand-off (a task, a
queue, an event, the device thread) where the callee starts with no caller of ours above it
(counted from "(hand-off)"). Repeated steps add nothing: each pair counts once. Files: the
files of every unit the request passes through.

    python scripts/hops.py [--max-tokens 8] [--list]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import threading
import types
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
OURS = ("core/", "engine/", "stages/", "kv/", "models/", "server.py", "api.py", "structured.py")
HAND_OFF = "(hand-off)"


def unit_of(code: types.CodeType) -> tuple[str, str] | None:
    """(file, unit) of a function of ours; None for anyone else's."""
    try:
        path = Path(code.co_filename).resolve().relative_to(ROOT).as_posix()
    except ValueError:
        return None
    if not path.startswith(OURS):
        return None
    owner = code.co_qualname.split(".")[0]
    module = path.removesuffix(".py").replace("/", ".")
    return path, f"{module}.{owner}" if owner[:1].isupper() else module


class Hops:
    def __init__(self) -> None:
        self.active = False
        self.pairs: set[tuple[str, str]] = set()
        self.files: set[str] = set()
        self.lock = threading.Lock()

    def profile(self, frame: types.FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        callee = unit_of(frame.f_code)
        if callee is None:
            return
        caller, up = HAND_OFF, frame.f_back
        while up is not None:
            found = unit_of(up.f_code)
            if found is not None:
                caller = found[1]
                break
            up = up.f_back
        with self.lock:
            self.files.add(callee[0])
            if caller != callee[1]:
                self.pairs.add((caller, callee[1]))


async def request(port: int, max_tokens: int) -> None:
    import aiohttp

    body = {
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
        "max_tokens": max_tokens,
        "stream": True,
    }
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        async with session.post(url, json=body) as response:
            assert response.status == 200, await response.text()
            async for _ in response.content:
                pass


async def trace(max_tokens: int) -> Hops:
    from engine.config import EngineConfig, SpecConfig
    from engine.engine import AsyncEngine
    from server import ServerOptions, start_server

    hops = Hops()
    sys.setprofile(hops.profile)
    threading.setprofile(hops.profile)  # the device thread, started by the engine
    engine = AsyncEngine(EngineConfig("demo", SpecConfig("draft")))
    await engine.start()
    runner = await start_server(engine, ServerOptions(port=0))
    port = runner.addresses[0][1]
    try:
        await request(port, max_tokens)  # first use: lazy set-up stays out of the count
        hops.active = True
        await request(port, max_tokens)
        hops.active = False
    finally:
        sys.setprofile(None)
        await runner.cleanup()
        await engine.stop()
    return hops


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--list", action="store_true", help="print every hop")
    args = parser.parse_args()
    hops = asyncio.run(trace(args.max_tokens))
    if args.list:
        for caller, callee in sorted(hops.pairs):
            print(f"{caller} -> {callee}")
        print(*sorted(hops.files), sep="\n")
    print(f"{len(hops.pairs)} hops in {len(hops.files)} files")


if __name__ == "__main__":
    main()
