"""`AsyncClient`: the asyncio flavour of client/pool.py's `Client`, many concurrent calls over one socket, replies
matched by request id (client/reader.py), each API call the same plan as the blocking client's (client/base.py).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import zmq

from laya_pool.protocol import contract, wire
from laya_pool.protocol.wire import Cmd

from .base import (
    BATCH_IN_FLIGHT,
    ForwardResult,
    _as_pool_errors,
    _Base,
    _feed_events,
    _several,
)
from .direct_async import AsyncRoutes
from .errors import PoolError
from .plans import Await, Many, NeedCard, Plan, T
from .reader import Reader
from .retry import Action, Attempts, Step, reply_error
from .watch import RECONNECTED, ConnectionWatch

__all__ = ["AsyncClient"]

log = logging.getLogger("laya-pool.client")


class AsyncClient(_Base):
    """The asyncio flavour: many concurrent calls over one socket, replies matched by request id.
    `AsyncClient([ep1, ep2, ...])`: a client of several pools (client/pools.py `AsyncPools`), as `Client`'s."""

    def __new__(cls, endpoint: str | Sequence[str] | None = None, **kwargs: Any) -> AsyncClient:
        if cls is AsyncClient and _several(endpoint):
            from .pools import AsyncPools
            cls = AsyncPools
        return super().__new__(cls)

    def __init__(self, endpoint: str | Sequence[str] | None = None, *, timeout: float = contract.CALL_TIMEOUT_S,
                 retries: int = 3, backoff: float = 0.05, max_backoff: float = 1.0, keys: str | None = None,
                 context: Any = None, operator: str | None = None, key_role: str = "client",
                 connect_timeout: float = contract.CONNECT_TIMEOUT_S, lang_temperatures: dict[str, Any] | None = None,
                 calibration: str | os.PathLike | dict[str, Any] | None = None, direct: bool = True,
                 lanes: bool = True, bundles: bool = True, together: bool = False, max_state_bytes: int | None = None):
        """As `Client`'s. `direct` on by default: 64 requests of 1x48 in flight from 8 processes, 5,436 req/s direct
        (p50 9.41 ms) against 4,234 through the broker (12.17 ms), same machine (H200;
        docs/decisions/0014-clients-straight-to-the-workers.md). `lanes`: a first attempt to a worker on this host goes
        through shared memory when its lane is free and the worker polls (protocol/lane.py), if other calls of this
        client are out (a lone call goes on the socket); the event loop never polls or sleeps on a lane, so the worker
        also rings each answer on the route's socket, which the loop reads. `bundles`: a worker may answer several of
        this client's direct requests of one forward in one message (a BUNDLE, docs/protocol.md), which halves the
        worker's host time a reply and cuts this client's by a fifth; off, every reply comes alone (for A/B runs).
        `together` (off by default): with other calls out, the direct requests of one turn of the event loop go to their
        worker in one REQUESTS message (`_send_together`). It cuts the worker's host time a request, but on a GPU
        it gained no throughput and widened the tail (H100: 256 in flight p95 34.9-69.8 ms against 26.9-27.0 alone,
        the same req/s; 64 in flight the same, or 10% fewer req/s on a slower host;
        docs/decisions/0017-bundles-on-requests-opt-in.md): the requests of one turn wait for the turn to end."""
        super().__init__(endpoint, timeout, retries, backoff, max_backoff, keys, connect_timeout, max_state_bytes)
        self.operator, self.key_role = operator, key_role
        self.bundles, self.together = bundles, together
        self._set_decoding(lang_temperatures, calibration)
        import zmq.asyncio

        self._ctx = context or zmq.asyncio.Context.instance()
        self._sock, self._mon = self._socket(self._ctx)
        # Replies are read by a callback on the socket's descriptor (client/reader.py), through a plain view of it,
        # which every send goes through too.
        self._plain = zmq.Socket.shadow(self._sock.underlying)
        # Route sockets are plain ones on the same context (a non-blocking send is refused at once, as Client's),
        # read the same way (client/direct_async.py).
        self._direct = AsyncRoutes(self, self._ctx, lanes) if direct else None
        self._routes = self._direct.routes if self._direct is not None else None
        self._waiters: dict[int, asyncio.Future] = {}
        self._reader: Reader | None = None
        self._card_lock: asyncio.Lock | None = None
        # The same watch as Client's (client/watch.py), read by a task of its own instead of a poller.
        self._watch = ConnectionWatch()
        # A blocking view of the same monitor socket: a send refused at once (the pool refuses our handshake)
        # must read the events now, for the error's text, not when the watcher task next runs.
        self._mon_now = zmq.Socket.shadow(self._mon.underlying)
        self._watcher: asyncio.Task | None = None

    # -- the pool's API (the same as Client's, awaited) ------------------------------------------------------
    async def forward(self, rows: Sequence[tuple[Any, Any, int]], *, timeout: float | None = None,
                      retries: int | None = None, worker: str | None = None, mode: str | None = None,
                      taps: bool = False) -> ForwardResult:
        return await self._run(self._forward_plan(rows, timeout, retries, worker, mode, taps))

    async def predict(self, state: Any, questions: dict[Any, Any], lang: str | None = None, *,
                      max_len: int | None = None, head_max_len: int | None = None,
                      min_confidence: float | dict[str, float] | None = None, timeout: float | None = None,
                      retries: int | None = None, worker: str | None = None, mode: str | None = None) -> dict[str, Any]:
        return await self._run(self._predict_plan(state, questions, timeout, retries, max_len, head_max_len,
                                                  worker, mode, lang, min_confidence))

    system_one = predict

    async def predict_batch(self, states: Sequence[Any], questions: dict[Any, Any], batch_size: int | None = None,
                            lang: str | None = None, *, max_len: int | None = None, head_max_len: int | None = None,
                            sort_by_length: bool = False, min_confidence: float | dict[str, float] | None = None,
                            timeout: float | None = None, retries: int | None = None, worker: str | None = None,
                            mode: str | None = None) -> list[dict[str, Any]]:
        # The requests of one batch are in flight together (as in Client).
        return await self._run(self._predict_batch_plan(states, questions, lang, max_len, head_max_len,
                                                        min_confidence, batch_size, timeout, retries, worker, mode))

    async def predict_long(self, state: Any, questions: dict[Any, Any], window: int | None = None,
                           stride: int | None = None, aggregate: str = "auto", batch_size: int | None = None,
                           lang: str | None = None, *, timeout: float | None = None, retries: int | None = None,
                           worker: str | None = None, mode: str | None = None) -> dict[str, Any]:
        return await self._run(self._predict_long_plan(state, questions, window, stride, aggregate, batch_size, lang,
                                                       timeout, retries, worker, mode))

    async def decide(self, state: Any, schema: Any = None, *, questions: dict[str, Any] | None = None,
                     return_details: bool = False, min_confidence: float | dict[str, float] | None = None,
                     lang: str | None = None, max_len: int | None = None, head_max_len: int | None = None,
                     timeout: float | None = None, retries: int | None = None, worker: str | None = None,
                     mode: str | None = None) -> Any:
        return await self._run(self._decide_plan(state, schema, questions, return_details, min_confidence, lang,
                                                 max_len, head_max_len, timeout, retries, worker, mode))

    async def decide_batch(self, states: Sequence[Any], schema: Any = None, *,
                           questions: dict[str, Any] | None = None, return_details: bool = False,
                           min_confidence: float | dict[str, float] | None = None, batch_size: int | None = None,
                           lang: str | None = None, max_len: int | None = None, head_max_len: int | None = None,
                           sort_by_length: bool = False, timeout: float | None = None, retries: int | None = None,
                           worker: str | None = None, mode: str | None = None) -> list[Any]:
        return await self._run(self._decide_batch_plan(states, schema, questions, return_details, min_confidence,
                                                       batch_size, lang, max_len, head_max_len, timeout, retries,
                                                       worker, mode))

    async def describe(self, *, timeout: float | None = None, refresh: bool = False) -> dict[str, Any]:
        # One describe at a time: concurrent first calls share the card instead of each asking for it.
        if self._card_lock is None:
            self._card_lock = asyncio.Lock()
        async with self._card_lock:
            return await self._run(self._describe_plan(timeout, refresh))

    async def card(self, *, timeout: float | None = None, refresh: bool = False) -> Any:
        if refresh and self._routes is not None:
            self._routes.next_ask = 0.0     # a new card (a reload): ask which workers serve it before going direct
        if self._card is None or refresh:
            await self.describe(timeout=timeout, refresh=True)
        return self._card

    async def status(self, *, timeout: float | None = None, retries: int | None = None) -> dict[str, Any]:
        return await self._run(self._status_plan(timeout, retries))

    async def drain(self, worker: str, *, restart: bool = False, timeout: float | None = None) -> dict[str, Any]:
        return await self._run(self._drain_plan(worker, restart, timeout))

    async def ping(self, *, timeout: float | None = None) -> float:
        return await self._run(self._ping_plan(timeout))

    # -- the driver ----------------------------------------------------------------------------------------
    async def _run(self, plan: Plan[T], started: float | None = None) -> T:
        # One deadline for the whole call, whatever pool calls it takes (`started`: the call's, for a part of one).
        started = time.monotonic() if started is None else started
        with _as_pool_errors():
            try:
                step = next(plan)
                while True:
                    if isinstance(step, NeedCard):
                        step = plan.send(await self.card(timeout=self._left(step.timeout, started),
                                                         refresh=step.refresh))
                    elif isinstance(step, Await):
                        waited = asyncio.wrap_future(step.future)
                        done, _ = await asyncio.wait((waited,), timeout=self._left(step.timeout, started))
                        if not done:
                            raise self._tokenizing_timeout(step.timeout)
                        step = plan.send(waited.result())
                    elif isinstance(step, Many):
                        step = plan.send(await self._run_all(step.plans, started))
                    else:
                        step = plan.send(await self.call(step.cmd, step.build, step.timeout, step.retries,
                                                         step.on_sent, started=started, direct=step.direct))
            except StopIteration as done:
                return done.value

    async def _run_all(self, plans: list[Plan[Any]], started: float | None = None) -> list[Any]:
        """The plans concurrently (at most `BATCH_IN_FLIGHT` at a time), results in order; the first failure cancels
        the rest and is raised. The first `BATCH_IN_FLIGHT` share the call's deadline (`started`), each later one has
        its own from when it starts (as `Flights` does). One plan runs in the caller's task."""
        if len(plans) < 2:
            return [await self._run(p, started) for p in plans]
        slots = asyncio.Semaphore(BATCH_IN_FLIGHT)

        async def run(plan: Plan[Any], i: int) -> Any:
            async with slots:
                return await self._run(plan, started if i < BATCH_IN_FLIGHT else None)
        tasks = [asyncio.ensure_future(run(p, i)) for i, p in enumerate(plans)]
        try:
            return list(await asyncio.gather(*tasks))
        finally:
            for t in tasks:
                t.cancel()

    def _received(self, frames: list[bytes], source: str = "the pool", route: Any = None) -> None:
        """A reply read from the broker's socket (or `route`'s, client/direct_async.py): to its call."""
        if route is not None:
            self._routes.heard_from(route)
        try:
            msg = wire.decode(frames)
        except wire.ProtocolError as e:
            # It cannot be matched to a call, so it fails none of them: each waits for its own reply
            # (or times out and retries with the same id, which the broker answers from its cache).
            log.warning("dropped an undecodable message from %s (%s)", source, e)
            return
        if route is not None and not route.together and msg.header.get(wire.TOGETHER) is True:
            route.together = True         # its worker takes REQUESTS (client/direct_async.py `_send_together`)
        self._deliver(msg)

    def _deliver(self, msg: wire.Message) -> None:
        if msg.cmd == Cmd.BUNDLE:
            try:
                replies = wire.unbundle(msg)
            except wire.ProtocolError as e:      # as an undecodable message: each call waits for its own reply
                log.warning("dropped a bundle that does not add up (%s)", e)
                return
            for reply in replies:
                self._deliver(reply)
            return
        rid = msg.header.get("rid")
        if self._routes is not None:
            self._routes.replied(msg.header)
            if self._routes.waiting and self._routes.lane_ready():     # a ring: answers (or a close) on lanes
                self._direct.lane_answers()
        fut = self._waiters.get(rid)
        if fut is not None and not fut.done():
            fut.set_result(msg)

    async def _watch_connection(self) -> None:
        """Wait for monitor events (polled, never received here, so `_events` may read them at any time)."""
        while True:
            await self._mon.poll(flags=zmq.POLLIN)
            self._events()

    def _events(self) -> None:
        """Read the monitor's events; when the connection came back after a drop (a new broker, which never
        saw what we sent), wake every call waiting for a reply so that it re-sends now."""
        if _feed_events(self._watch, self._mon_now):
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_result(RECONNECTED)

    async def _send(self, frames: list[Any], attempts: Attempts, rid: int | None = None) -> Step:
        # Never block on a full queue (no connection, or the pool refuses our handshake): back off and retry,
        # and run out of attempts with the reason, as Client does. The first attempt of a request that may go
        # direct (`rid`) goes to a worker when one takes it (client/direct.py).
        framed = wire.with_budget(frames, attempts.budget_ms())
        if rid is not None and self._routes is not None:
            if attempts.attempts == 1:
                if await self._direct.send(rid, framed):
                    return attempts.sent(True)
            else:
                self._routes.detach(rid, blame=attempts.silent)
        try:
            self._plain.send_multipart(framed, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._events()
            return attempts.send_failed(self._watch.trouble or "the socket's send queue is full", self._watch.up)
        finally:
            self._reader.sent()
        return attempts.sent(self._watch.up)

    async def call(self, cmd: Cmd, build: Callable[[int, str], list[Any]], timeout: float | None = None,
                   retries: int | None = None, on_sent: Callable[[], None] | None = None,
                   started: float | None = None, direct: bool = False) -> tuple[wire.Message, int]:
        if self._sock is None:
            raise PoolError("the client is closed")
        attempts = self._attempts(timeout, retries, started)
        if self._reader is None or not self._reader.live():
            if self._reader is not None:
                self._reader.close()
            self._reader = Reader(self._plain, self._received, "the pool")
        if self._watcher is None or self._watcher.done():
            self._watcher = asyncio.ensure_future(self._watch_connection())
        if direct and self._direct is not None:
            await self._direct.ask()
        rid = next(self._rids)
        frames = build(rid, self.cid)
        loop = asyncio.get_running_loop()
        try:
            step, fut, msg = attempts.start(), None, None
            while True:
                if step.sleep:
                    await asyncio.sleep(step.sleep)
                if step.action is Action.SEND:
                    fut = self._waiters[rid] = loop.create_future()
                    step = await self._send(frames, attempts, rid if direct else None)
                    if on_sent is not None:
                        on_sent()
                        on_sent = None
                elif step.action is Action.WAIT:
                    # asyncio.wait, not wait_for: the future must survive a wait that ends early (woken to look
                    # at the connection), since the reply may still come to it.
                    await asyncio.wait((fut,), timeout=step.seconds)
                    if not fut.done():
                        step = attempts.woke(self._watch.up, self._watch.trouble)
                        continue
                    msg = fut.result()
                    if msg is RECONNECTED:       # a new broker, or the worker it went to: it died with it
                        step, msg = attempts.reconnected(), None
                        continue
                    step = attempts.replied(msg.header.get("status"), reply_error(msg.header))
                elif step.action is Action.RETURN:
                    return msg, attempts.attempts
                else:
                    raise attempts.error(self.endpoint)
        finally:
            self._waiters.pop(rid, None)
            if self._routes is not None:
                self._routes.answered(rid)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
        if self._watcher is not None:
            self._watcher.cancel()
        self._reader = self._watcher = None
        if self._routes is not None:
            self._routes.close()
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            self._mon.close(0)
            self._sock.close(0)
            self._sock = None

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.close()
