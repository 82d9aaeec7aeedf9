"""The gateway's HTTP app: `laya serve` 0.4.15's API, answered by a pool through one `AsyncClient`.

Routes (as `laya serve`'s, FastAPI's own included):
    POST /v1/systemone         {"state", "questions", ...}: the SDK's answer dict, `routing`, `x_jev_confidence`
    POST /v1/systemone/batch   {"states", "questions", ...}: {"results": [...], "total_usage": {...}}
    GET  /health               liveness (`{"status": "ok"}`); with the key (or none set), the pool's state as well
    GET  /openapi.json, /docs, /redoc   the API's schema (not served when an API key is set, as `laya serve`)

Each decision request is admitted (at most `max_concurrent` at once, else 503 before its body is read), its body read
within `read_timeout` (408) and 2 MiB (413), checked as `laya serve` checks it (gateway/calls.py), then answered by
the pool: one `predict` (or `predict_batch`) call on the process's one AsyncClient, so concurrent HTTP requests are
concurrent pool requests, which the workers merge into shared forwards. What the pool says maps to HTTP: busy -> 503
with Retry-After, no worker / unreachable / out of time -> 503, a request larger than the pool takes -> 413, input the
SDK refuses -> 422 with its message, anything else -> 500 "inference failed" (the cause in the log only).
"""
import asyncio
import hmac
import logging
import math
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Header, Request
from fastapi.responses import JSONResponse

from laya_pool.client.errors import (
    PoolBusy,
    PoolError,
    PoolNoWorker,
    PoolTimeout,
    PoolUnavailable,
    PoolUnreachable,
    RequestFailed,
)
from laya_pool.client.pool_async import AsyncClient
from laya_pool.protocol.contract import Reason, WorkerState

from . import calls, jev, limits, routes
from .limits import Refusal
from .naming import Checkpoint
from .options import GatewayConfig

log = logging.getLogger("laya-pool.gateway")

LIVENESS = {"status": "ok"}
STATUS_TTL_S = 1.0          # /health asks the pool at most once a second, however often it is called
UNAVAILABLE = ((PoolNoWorker, "no worker serves the model now, try again later"),
               (PoolUnreachable, "the pool is unreachable, try again later"),
               (PoolTimeout, "the pool did not answer in time, try again later"))


def refusal_for(e: Exception) -> Refusal:
    """The HTTP answer to an error a pool call raised."""
    if isinstance(e, PoolBusy):
        return Refusal(503, limits.BUSY, {"Retry-After": str(max(1, math.ceil(e.retry_after or 1)))})
    if isinstance(e, PoolUnavailable):
        detail = next((text for kind, text in UNAVAILABLE if isinstance(e, kind)),
                      "the pool is unavailable, try again later")
        return Refusal(503, detail, {"Retry-After": "1"})
    if isinstance(e, RequestFailed) and e.reason == Reason.TOO_LARGE:
        return Refusal(413, str(e))
    if isinstance(e, ValueError) and not isinstance(e, PoolError):
        return Refusal(422, str(e))         # the SDK's own refusal of the questions or the state, its words
    log.error("inference failed: %s: %s", type(e).__name__, e, exc_info=e)
    return Refusal(500, "inference failed")


def timing(ms: float) -> dict[str, str]:
    return {"Server-Timing": f"inference;dur={ms:.2f}", "X-Inference-Time-Ms": f"{ms:.2f}"}


class Gateway:
    """What the routes share: the pool client, the admission bound, the API key, the pool's status for /health."""

    def __init__(self, cfg: GatewayConfig, client_factory: Callable[[], Any]):
        self.cfg = cfg
        self.checkpoint = Checkpoint(cfg.model_name)
        self.expected = ("Bearer " + cfg.api_key).encode("utf-8", "surrogateescape") if cfg.api_key else b""
        self.client_factory = client_factory
        self.client: Any = None
        self.admission: asyncio.Semaphore | None = None
        self.status: tuple[float, dict[str, Any] | None] = (float("-inf"), None)
        self.status_lock: asyncio.Lock | None = None

    def start(self) -> None:
        """In the server's event loop: the client's sockets and the locks bind to it."""
        self.client = self.client_factory()
        self.admission = asyncio.Semaphore(self.cfg.max_concurrent)
        self.status_lock = asyncio.Lock()

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None

    # -- auth and admission (laya serve's) ------------------------------------------------------------------------
    def authorized(self, authorization: str | None) -> bool:
        """Compared as bytes in constant time: any header a client can send answers 401, never 500."""
        if not self.cfg.api_key:
            return True
        return hmac.compare_digest((authorization or "").encode("utf-8", "surrogateescape"), self.expected)

    def check_auth(self, authorization: str | None) -> None:
        if not self.authorized(authorization):
            raise Refusal(401, "invalid or missing bearer token")

    @asynccontextmanager
    async def admit(self):
        """A slot, taken before the body is read (bounding the bodies buffered at once), or 503 at once."""
        if self.admission.locked():
            raise limits.busy()
        await self.admission.acquire()
        try:
            yield
        finally:
            self.admission.release()

    # -- a decision request -------------------------------------------------------------------------------------
    async def read_body(self, content_length: str | None, receive: Any) -> Any:
        """The JSON body from the ASGI `receive`: at most MAX_BODY_BYTES however it is framed (413), within
        read_timeout (408)."""
        if limits.declared_too_large(content_length):
            raise Refusal(413, "request body too large")

        async def collect() -> bytes:
            total, chunks = 0, []
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise Refusal(400, "the client closed the connection before its body arrived")
                chunk = message.get("body", b"")
                total += len(chunk)
                if total > limits.MAX_BODY_BYTES:
                    raise Refusal(413, "request body too large")
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)
        try:
            raw = await asyncio.wait_for(collect(), self.cfg.read_timeout)
        except asyncio.TimeoutError:
            raise Refusal(408, "request body was not received in time") from None
        return limits.parse_json(raw)

    async def answer(self, content_length: str | None, receive: Any, plan: Callable[[Any, Checkpoint], calls.Call],
                     batch: bool) -> tuple[Any, dict[str, str]]:
        """A decision request's answer (the JSON content and its headers); a Refusal for an HTTP error."""
        call = plan(await self.read_body(content_length, receive), self.checkpoint)
        t0 = time.perf_counter()
        try:
            if batch:
                results = await self.client.predict_batch(call.states, call.questions, **call.kwargs)
            else:
                results = [await self.client.predict(call.states[0], call.questions, **call.kwargs)]
        except Exception as e:  # noqa: BLE001 - every failure becomes an HTTP answer (refusal_for)
            raise refusal_for(e) from None
        ms = (time.perf_counter() - t0) * 1e3
        shown = [self.shape({**r, "routing": call.routing}) for r in results]
        if not batch:
            return shown[0], timing(ms)
        total = {key: sum(r.get("usage", {}).get(key, 0) for r in results) for key in ("input_tokens",
                                                                                         "output_tokens")}
        return {"results": shown, "total_usage": total}, timing(ms)

    def shape(self, result: dict[str, Any]) -> dict[str, Any]:
        return jev.project_strict(result) if self.cfg.jev_strict else jev.add_jev_confidence(result)

    # -- health ---------------------------------------------------------------------------------------------------
    async def pool_status(self) -> dict[str, Any] | None:
        """The pool's status, at most STATUS_TTL_S old; None when it does not answer."""
        async with self.status_lock:
            when, st = self.status
            if time.monotonic() - when > STATUS_TTL_S:
                try:
                    st = await self.client.status(timeout=1.0, retries=0)
                except PoolError:
                    st = None
                self.status = (time.monotonic(), st)
            return st

    async def health(self) -> dict[str, Any]:
        """laya serve's keys, for the pool's one checkpoint, and `x_pool`: the workers, how many are ready."""
        st = await self.pool_status()
        workers = (st or {}).get("workers", [])
        ready = [w for w in workers if w.get("state") == WorkerState.READY]
        devices = sorted({str(w.get("device")) for w in ready})
        name, fingerprint = self.checkpoint.name, (st or {}).get("broker", {}).get("fingerprint")
        here = {name: devices[0]} if devices else {}
        return {"status": "ok", "loaded": list(here), "revisions": {n: fingerprint for n in here},
                "device": devices[0] if devices else None, "device_is_preference": not devices,
                "checkpoint_devices": here, "cpu_fallbacks": {n: {"count": 0, "last_reason": None} for n in here},
                "x_pool": {"reachable": st is not None, "workers": len(workers), "ready": len(ready),
                           "devices": devices, "frontend": self.cfg.frontend}}


async def _refused(_request: Request, exc: Refusal) -> JSONResponse:
    return JSONResponse({"detail": exc.detail}, status_code=exc.status, headers=exc.headers)


def create_app(cfg: GatewayConfig, client_factory: Callable[[], Any] | None = None) -> FastAPI:
    """The app; `client_factory` (default: an AsyncClient on cfg.frontend) is called once the event loop runs."""
    gw = Gateway(cfg, client_factory or (lambda: AsyncClient(cfg.frontend, timeout=cfg.timeout, keys=cfg.keys)))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        gw.start()
        try:
            yield
        finally:
            gw.close()

    hidden = bool(cfg.api_key)          # the schema and the consoles would answer without the key: not served
    app = FastAPI(title="laya-pool", summary="Laya decisions from a laya-pool, over the SDK server's /v1/systemone "
                  "protocol (TypeSafe Jev)", root_path=cfg.root_path, lifespan=lifespan,
                  docs_url=None if hidden else "/docs", redoc_url=None if hidden else "/redoc",
                  openapi_url=None if hidden else "/openapi.json")
    app.add_exception_handler(Refusal, _refused)
    app.state.gateway = gw

    @app.get("/health")
    async def health(authorization: str | None = Header(default=None)) -> dict[str, Any]:
        if not gw.authorized(authorization):
            return LIVENESS
        return await gw.health()

    # Answered by gateway/routes.py, in front of this app; declared here for the OpenAPI document and 405s, and
    # answered the same way when the app is served alone.
    @app.post("/v1/systemone")
    async def systemone(request: Request, authorization: str | None = Header(default=None)):
        return routes.Answer(gw, routes.ROUTES["/v1/systemone"])

    @app.post("/v1/systemone/batch")
    async def systemone_batch(request: Request, authorization: str | None = Header(default=None)):
        return routes.Answer(gw, routes.ROUTES["/v1/systemone/batch"])

    return app
