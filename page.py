"""The chat page at /: static files from static/, no build step and nothing from elsewhere.

The page and its assets load without the API key (the key is typed into the page, which sends
it as a bearer token), and the browser guard lets the page's own origin through.
"""

from __future__ import annotations

import html
from pathlib import Path

from aiohttp import web

STATIC = Path(__file__).resolve().parent / "static"


def is_public(request: web.Request) -> bool:
    """The page and its assets: what a browser fetches before anyone could type a key."""
    return request.method in ("GET", "HEAD") and (
        request.path == "/" or request.path.startswith("/static/")
    )


def is_same_origin(request: web.Request, origin: str) -> bool:
    """A request from the page this server served (browsers send Origin on its POSTs)."""
    return origin == f"{request.scheme}://{request.host}"


def add_routes(app: web.Application, model: str, key_required: bool) -> None:
    """GET / (the page, with the model's name in it) and GET /static/*."""
    text = (STATIC / "index.html").read_text()
    text = text.replace("__MODEL__", html.escape(model))
    text = text.replace("__KEY_REQUIRED__", "true" if key_required else "false")

    async def index(request: web.Request) -> web.Response:
        return web.Response(text=text, content_type="text/html", charset="utf-8")

    app.router.add_get("/", index)
    app.router.add_static("/static", STATIC)
