"""The decision routes, `POST /v1/systemone` and `POST /v1/systemone/batch`, answered as plain ASGI.

The FastAPI app (gateway/app.py) declares them, for its OpenAPI document and its 405 to another method, and answers
them with `Answer`. In front of it, `in_front` answers them before FastAPI's and Starlette's layers (six middlewares,
the router, the dependencies, a Request and a Response object a request) are entered: before a stub worker those
layers were a quarter of a gateway process's CPU a decision (docs/decisions/0026-decision-routes-as-asgi.md). Either
way `answer` runs, so the answers are the same bytes: Starlette's JSON rendering and header order, 500 "Internal
Server Error" for a fault.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any

from starlette.responses import Response

from . import calls
from .limits import Refusal

log = logging.getLogger("laya-pool.gateway")

# path -> (the body's checks and the pool call, whether it is the batch route)
ROUTES: dict[str, tuple[Callable[..., calls.Call], bool]] = {
    "/v1/systemone": (calls.single, False),
    "/v1/systemone/batch": (calls.batch, True),
}
JSON_TYPE = (b"content-type", b"application/json")
FAULT = b"Internal Server Error"


def render(content: Any) -> bytes:
    """JSON as Starlette's JSONResponse renders it."""
    return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def header(scope: dict[str, Any], name: bytes) -> str | None:
    """A request header's first value, as Starlette's `request.headers.get` reads it (the server lowercases names)."""
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


def route_path(scope: dict[str, Any], root_path: str) -> str:
    """The path the app routes on: `root_path` taken off where the path starts with it (Starlette's rule)."""
    path = scope["path"]
    if root_path and path.startswith(root_path):
        if path == root_path:
            return ""
        if path[len(root_path)] == "/":
            return path[len(root_path):]
    return path


async def send_json(send: Any, status: int, content: Any, headers: dict[str, str] | None) -> None:
    body = render(content)
    raw = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    raw += [(b"content-length", str(len(body)).encode("latin-1")), JSON_TYPE]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


async def answer(gw: Any, route: tuple[Callable[..., calls.Call], bool], scope: dict[str, Any], receive: Any,
                 send: Any) -> None:
    """One decision request, whole: the key, a slot, the body, the pool's answer or the refusal, sent."""
    plan, batch = route
    try:
        try:
            gw.check_auth(header(scope, b"authorization"))
            async with gw.admit():
                content, headers = await gw.answer(header(scope, b"content-length"), receive, plan, batch)
            status = 200
        except Refusal as r:
            status, content, headers = r.status, {"detail": r.detail}, r.headers
        await send_json(send, status, content, headers)
    except Exception:
        # As Starlette's ServerErrorMiddleware: a plain 500 (an answer whose JSON could not be rendered: not sent
        # yet), and the fault raised on for the server to log.
        await send({"type": "http.response.start", "status": 500,
                    "headers": [(b"content-length", str(len(FAULT)).encode()),
                                (b"content-type", b"text/plain; charset=utf-8")]})
        await send({"type": "http.response.body", "body": FAULT})
        raise


class Answer(Response):
    """What FastAPI's routes return: a response that answers as `answer` does."""

    def __init__(self, gw: Any, route: tuple[Callable[..., calls.Call], bool]):
        super().__init__()
        self.gw, self.route = gw, route

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        await answer(self.gw, self.route, scope, receive, send)


def in_front(app: Any) -> Callable[..., Any]:
    """`app` (gateway/app.py's) with its decision routes answered before it is entered."""
    gw, root_path = app.state.gateway, app.root_path

    async def asgi(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = ROUTES.get(route_path(scope, root_path))
            if route is not None:
                await answer(gw, route, scope, receive, send)
                return
        await app(scope, receive, send)
    return asgi
