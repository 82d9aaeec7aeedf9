"""Talking to a laya-pool: `Client` (blocking, here), `AsyncClient` (asyncio: client/pool_async.py) and `local_pool`
(a pool for a `with`: client/local.py).

    from laya_pool import Client
    c = Client("tcp://127.0.0.1:5555")
    c.predict("the printer on floor 3 is broken", {"team": {...}})   # the SDK's Agent.predict() dict

Each client holds ONE long-lived DEALER socket to the broker (and the blocking `Client` one to each worker on its
host that takes requests itself, where a request's first attempt goes: client/direct.py). A call has one
deadline (`timeout`, 10 s by default) and sends one request with a fresh request id and the time it has left; on
silence or a "retryable" reply (busy, a worker lost) it sends the same request again with the SAME request id, after
the pool's retry-after or a short backoff, within the deadline (Lazy Pirate, without recreating the socket: replies
carrying another id are stale answers to earlier attempts and are dropped). The broker deduplicates by
(client id, request id), so a retry never runs a request twice, and drops work whose caller gave up. A
"final" reply (the request itself is wrong) raises `RequestFailed` naming the field and row; no answer
raises a `PoolUnavailable`, typed by why: `PoolBusy` (with `retry_after`), `PoolNoWorker`,
`PoolUnreachable` (nothing listens: said within `connect_timeout`, 3 s), `PoolTimeout`. Every error a call
raises is a `PoolError` (client/errors.py).

The two clients share everything but the socket (client/base.py): the retry rules are `client.retry.Attempts` (no
I/O), and each API call (`forward`, `predict`, `describe`, `status`, `drain`, `ping`) is written once as a plan, a
generator that yields the pool calls it needs and gets their answers back. `Client` runs a plan with blocking calls,
`AsyncClient` with awaited ones.

The model card (tokenizer and config) comes from the pool with a describe call, so a client needs no
files. This module imports neither torch nor anything from the worker or broker packages.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import threading
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
from .direct import RETRY_S, ROUTES_TIMEOUT_S, Routes
from .errors import PoolError
from .flights import Flights
from .plans import Await, Call, Many, NeedCard, Plan, T, header_only
from .receiver import Receiver
from .retry import Action, Attempts, Step, reply_error
from .watch import RECONNECTED, ConnectionWatch

__all__ = ["Client"]


class Client(_Base):
    """A blocking client over one DEALER socket. Thread-safe: calls from several threads take turns
    (use one client per thread, or `AsyncClient`, for concurrent requests from one process).

    `Client([ep1, ep2, ...])` is a client of several pools (client/pools.py `Pools`, a Client): each call goes to the
    pool with the fewest of its calls outstanding and fails over to another within its deadline."""

    def __new__(cls, endpoint: str | Sequence[str] | None = None, **kwargs: Any) -> Client:
        if cls is Client and _several(endpoint):
            from .pools import Pools
            cls = Pools
        return super().__new__(cls)

    def __init__(self, endpoint: str | Sequence[str] | None = None, *, timeout: float = contract.CALL_TIMEOUT_S,
                 retries: int = 3, backoff: float = 0.05, max_backoff: float = 1.0, keys: str | None = None,
                 context: zmq.Context | None = None, operator: str | None = None, key_role: str = "client",
                 connect_timeout: float = contract.CONNECT_TIMEOUT_S, lang_temperatures: dict[str, Any] | None = None,
                 calibration: str | os.PathLike | dict[str, Any] | None = None, spin_ms: float | None = None,
                 direct: bool = True, lanes: bool = True, max_state_bytes: int | None = None):
        """`timeout`: each call's deadline in seconds (a call may override it), retries included; `retries`:
        re-sends within it; `connect_timeout`: with no connection to the pool this long, a call raises
        `PoolUnreachable`. `operator`: the pool's operator secret (what `laya-pool drain` reads), needed only
        by `drain`; `key_role="operator"` connects with the operator CURVE key pair in `keys`;
        `lang_temperatures` (per-language temperatures for `predict(..., lang=)`) and `calibration` (a file
        `Agent.save_calibration` wrote) as `laya.load` takes them: they change how answers are decoded here.
        `spin_ms`: wait for a reply by polling without sleeping for up to this long first (0: sleep at once). A thread
        that sleeps through a forward may wake 0.1-0.2 ms late (measured on VM hosts whose idle is the hypervisor's;
        docs/decisions/0015-poll-windows.md); polling keeps it awake, at the price of a core (and of the GIL, in turns)
        while a call waits. None (default): poll a request on a lane for up to LANE_SPIN_MS if no other thread of this
        process could want the GIL (which the polling would keep from it), sleep at once for anything else.
        `direct`: send a request's first attempt to a worker that takes requests itself, if the pool has any (on
        this host; in a pool with keys, on any host: client/direct.py); every other attempt, and every other call,
        goes through the broker.
        `lanes`: ... and through shared memory when that worker takes it (protocol/lane.py).
        `max_state_bytes`: a state whose text (UTF-8; a dict or list as JSON) is larger is refused at once with
        `RequestFailed` naming `state` (default $LAYA_POOL_MAX_STATE_BYTES, 16 MiB)."""
        super().__init__(endpoint, timeout, retries, backoff, max_backoff, keys, connect_timeout, max_state_bytes)
        if spin_ms is not None and spin_ms < 0:
            raise ValueError(f"spin_ms must be >= 0, got {spin_ms}")
        self.spin = (spin_ms or 0.0) / 1000.0
        self.spin_auto = spin_ms is None
        self.operator, self.key_role = operator, key_role
        self._set_decoding(lang_temperatures, calibration)
        self._ctx = context or zmq.Context.instance()
        # Re-entrant: a batch's calls hold it from the first send to the last reply (Client._run_all), and a plan
        # step inside them (a card) may make a call of its own.
        self._lock = threading.RLock()
        self._sock, self._mon = self._socket(self._ctx)
        self._pid = os.getpid()
        self._watch = ConnectionWatch()
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._mon, zmq.POLLIN)
        self._routes = (Routes(self._ctx, self._poller, wire.MAX_BODY_BYTES + wire.MAX_HEADER_BYTES, lanes=lanes,
                               keys=self.keys, key_role=self.key_role) if direct else None)
        self._receiver = Receiver(self._sock, self._mon, self._poller, self._routes, self.spin, self.spin_auto)

    # -- the pool's API ----------------------------------------------------------------------------------
    def forward(self, rows: Sequence[tuple[Any, Any, int]], *, timeout: float | None = None,
                retries: int | None = None, worker: str | None = None, mode: str | None = None,
                taps: bool = False) -> ForwardResult:
        """Run pre-encoded rows `(ids, markers, qtype)`; returns per-row logits and act probabilities."""
        return self._run(self._forward_plan(rows, timeout, retries, worker, mode, taps))

    def predict(self, state: Any, questions: dict[Any, Any], lang: str | None = None, *, max_len: int | None = None,
                head_max_len: int | None = None, min_confidence: float | dict[str, float] | None = None,
                timeout: float | None = None, retries: int | None = None, worker: str | None = None,
                mode: str | None = None) -> dict[str, Any]:
        """The SDK's `Agent.predict(state, questions, ...)` result (also `system_one`), computed by the pool.

        `lang` picks the temperatures of `lang_temperatures` (given to the client, as to `laya.load`);
        `min_confidence` (a float or a per-bucket map) marks answers below it, as the SDK does."""
        return self._run(self._predict_plan(state, questions, timeout, retries, max_len, head_max_len, worker, mode,
                                            lang, min_confidence))

    system_one = predict

    def predict_batch(self, states: Sequence[Any], questions: dict[Any, Any], batch_size: int | None = None,
                      lang: str | None = None, *, max_len: int | None = None, head_max_len: int | None = None,
                      sort_by_length: bool = False, min_confidence: float | dict[str, float] | None = None,
                      timeout: float | None = None, retries: int | None = None, worker: str | None = None,
                      mode: str | None = None) -> list[dict[str, Any]]:
        """The SDK's `Agent.predict_batch`: one `predict` result per state, in order. The states' rows travel
        in as few requests as the pool's capacity allows (`batch_size`: at most that many states per request);
        `sort_by_length` is accepted and has nothing to do (the workers choose their own shapes)."""
        return self._run(self._predict_batch_plan(states, questions, lang, max_len, head_max_len, min_confidence,
                                                  batch_size, timeout, retries, worker, mode))

    def predict_long(self, state: Any, questions: dict[Any, Any], window: int | None = None,
                     stride: int | None = None, aggregate: str = "auto", batch_size: int | None = None,
                     lang: str | None = None, *, timeout: float | None = None, retries: int | None = None,
                     worker: str | None = None, mode: str | None = None) -> dict[str, Any]:
        """The SDK's `Agent.predict_long`: a long state read in overlapping windows, one answer per question
        from its deciding window (`answer["window"]`), `usage["windows"]` the windows read (client/scan.py)."""
        return self._run(self._predict_long_plan(state, questions, window, stride, aggregate, batch_size, lang,
                                                 timeout, retries, worker, mode))

    def decide(self, state: Any, schema: Any = None, *, questions: dict[str, Any] | None = None,
               return_details: bool = False, min_confidence: float | dict[str, float] | None = None,
               lang: str | None = None, max_len: int | None = None, head_max_len: int | None = None,
               timeout: float | None = None, retries: int | None = None, worker: str | None = None,
               mode: str | None = None) -> Any:
        """The SDK's `Agent.decide`: a JSON schema or pydantic model (or `questions=`) answered as values
        (a `client.structured.DecisionResult` with `return_details`); a field below `min_confidence` is None."""
        return self._run(self._decide_plan(state, schema, questions, return_details, min_confidence, lang, max_len,
                                           head_max_len, timeout, retries, worker, mode))

    def decide_batch(self, states: Sequence[Any], schema: Any = None, *, questions: dict[str, Any] | None = None,
                     return_details: bool = False, min_confidence: float | dict[str, float] | None = None,
                     batch_size: int | None = None, lang: str | None = None, max_len: int | None = None,
                     head_max_len: int | None = None, sort_by_length: bool = False, timeout: float | None = None,
                     retries: int | None = None, worker: str | None = None, mode: str | None = None) -> list[Any]:
        """The SDK's `Agent.decide_batch`: `decide` over many states through `predict_batch`, in order."""
        return self._run(self._decide_batch_plan(states, schema, questions, return_details, min_confidence,
                                                 batch_size, lang, max_len, head_max_len, timeout, retries, worker,
                                                 mode))

    def describe(self, *, timeout: float | None = None, refresh: bool = False) -> dict[str, Any]:
        """The model card (what `Checkpoint.card()` returns), fetched once from the pool and cached."""
        return self._run(self._describe_plan(timeout, refresh))

    def card(self, *, timeout: float | None = None, refresh: bool = False) -> Any:
        """The `client.card.ModelCard` built from `describe()`."""
        if refresh and self._routes is not None:
            self._routes.next_ask = 0.0     # a new card (a reload): ask which workers serve it before going direct
        if self._card is None or refresh:
            self.describe(timeout=timeout, refresh=True)
        return self._card

    def status(self, *, timeout: float | None = None, retries: int | None = None) -> dict[str, Any]:
        """`{"workers": [{"id", "device", "state", ...}], "broker": {...}}`."""
        return self._run(self._status_plan(timeout, retries))

    def drain(self, worker: str, *, restart: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Stop dispatching to `worker`; it finishes its in-flight work and leaves (and with `restart`,
        the supervisor starts it again and it re-registers)."""
        return self._run(self._drain_plan(worker, restart, timeout))

    def reload(self, model: str, fingerprint: str, *, reload_id: str, timeout: float | None = None) -> dict[str, Any]:
        """Ask the pool to roll onto the checkpoint `model` (a directory the pool's supervisor reads) whose
        fingerprint is `fingerprint`; needs the operator credential. Returns at once: `status()` shows the
        workers move, one at a time (`laya-pool reload` follows it)."""
        return self._run(self._reload_plan(model, fingerprint, reload_id, timeout))

    def ping(self, *, timeout: float | None = None) -> float:
        """Round trip to the broker, in seconds."""
        return self._run(self._ping_plan(timeout))

    # -- the driver ----------------------------------------------------------------------------------------
    def _run(self, plan: Plan[T], started: float | None = None) -> T:
        # One deadline for the whole call, whatever pool calls it takes (`started`: the call's, for a part of one).
        started = time.monotonic() if started is None else started
        with _as_pool_errors():
            try:
                step = next(plan)
                while True:
                    if isinstance(step, Call):
                        step = plan.send(self.call(step.cmd, step.build, step.timeout, step.retries, step.on_sent,
                                                   started=started, direct=step.direct))
                    else:
                        step = plan.send(self._answer(step, started))
            except StopIteration as done:
                return done.value

    def _answer(self, step: NeedCard | Await | Many, started: float) -> Any:
        """The answer to a plan's step other than a pool call."""
        if isinstance(step, NeedCard):
            return self.card(timeout=self._left(step.timeout, started), refresh=step.refresh)
        if isinstance(step, Await):
            try:
                return step.future.result(timeout=self._left(step.timeout, started))
            except concurrent.futures.TimeoutError:
                raise self._tokenizing_timeout(step.timeout) from None
        return self._run_all(step.plans, started)

    # -- several plans' calls on the wire together (a predict_batch larger than one request) ----------------
    def _run_all(self, plans: list[Plan[Any]], started: float | None = None) -> list[Any]:
        """The plans with up to `BATCH_IN_FLIGHT` of their calls out at once over this one socket (client/flights.py),
        results in order: each plan runs until it asks for a pool call, and every call's attempts advance on their own
        (client/retry.py) as its reply, its timeout or the connection's events come. The first failure is raised;
        replies still owed to the other calls are dropped as stale when they come. The client's lock is held
        throughout, so calls from other threads take turns with the whole batch (they would drop its replies)."""
        if len(plans) < 2:
            return [self._run(p, started) for p in plans]
        with self._lock:
            if os.getpid() != self._pid:
                raise PoolError("a Client cannot be used across fork(); create one in the child")
            return Flights(self, plans, BATCH_IN_FLIGHT, started).run()

    def call(self, cmd: Cmd, build: Callable[[int, str], list[Any]], timeout: float | None = None,
             retries: int | None = None, on_sent: Callable[[], None] | None = None,
             started: float | None = None, direct: bool = False) -> tuple[wire.Message, int]:
        """Send, wait, retry with the same request id; returns the first non-retryable reply and the attempts.
        `on_sent` runs once, after the first send; the deadline is `timeout` from `started` (default: now).
        `direct`: the first attempt may go to a worker itself (client/direct.py)."""
        attempts = self._attempts(timeout, retries, started)
        rid = next(self._rids)
        frames = build(rid, self.cid)
        with self._lock:
            if self._sock is None:
                raise PoolError("the client is closed")
            if os.getpid() != self._pid:
                raise PoolError("a Client cannot be used across fork(); create one in the child")
            if direct:
                self._ask_routes()       # under the lock: the route sockets are this client's other sockets
            step, msg = attempts.start(), None
            try:
                while True:
                    if step.sleep:
                        time.sleep(step.sleep)
                    if step.action is Action.SEND:
                        step = self._send(frames, attempts, rid if direct else None)
                        if on_sent is not None:
                            on_sent()
                            on_sent = None
                    elif step.action is Action.WAIT:
                        msg = self._wait(rid, time.monotonic() + step.seconds)
                        if msg is RECONNECTED:       # a new broker, or the worker it went to: it died with it
                            step, msg = attempts.reconnected(), None
                        elif msg is None:
                            step = attempts.woke(self._watch.up, self._watch.trouble)
                        else:
                            step = attempts.replied(msg.header.get("status"), reply_error(msg.header))
                    elif step.action is Action.RETURN:
                        return msg, attempts.attempts
                    else:
                        raise attempts.error(self.endpoint)
            finally:
                self._forget(rid)

    # -- requests straight to the workers (client/direct.py) ------------------------------------------------
    def _ask_routes(self) -> None:
        """Ask the broker which workers take requests themselves, when the table is due (every few seconds, and
        soon after a route failed). A broker that does not answer in time leaves the table as it was."""
        routes = self._routes
        if routes is None or not routes.due(time.monotonic()):
            return
        routes.next_ask = time.monotonic() + RETRY_S      # this call's own ping must not ask again
        try:
            msg, _ = self.call(Cmd.HEARTBEAT, header_only(Cmd.HEARTBEAT, routes=True), ROUTES_TIMEOUT_S, 0)
            table = msg.header.get("routes", [])
        except PoolError:
            table = None
        routes.asked(table, time.monotonic())

    def _forget(self, rid: int) -> None:
        if self._routes is not None:
            self._routes.answered(rid)

    def _send(self, frames: list[Any], attempts: Attempts, rid: int | None = None) -> Step:
        """One attempt: the first of a request that may go direct (`rid` given) to a worker when one takes it, any
        other to the broker."""
        framed = wire.with_budget(frames, attempts.budget_ms())
        if rid is not None and self._routes is not None:
            if attempts.attempts == 1:
                if self._routes.send(rid, framed):
                    return attempts.sent(True)
            else:
                # A retry goes through the broker: the direct attempt is done with (its worker stays unused while
                # it is silent), and its connection's fate no longer concerns this call.
                self._routes.detach(rid, blame=attempts.silent)
        try:
            wire.send_frames(self._sock, framed, copy=False)
        except zmq.Again:
            self._events()
            return attempts.send_failed(self._watch.trouble or "the socket's send queue is full", self._watch.up)
        return attempts.sent(self._watch.up)

    def _events(self) -> bool:
        """Read the monitor's events; True if the connection came back after a drop."""
        return _feed_events(self._watch, self._mon)

    def _wait(self, rid: int, deadline: float) -> Any:
        while True:
            remaining = deadline - time.monotonic()
            ready = self._receiver.poll(max(1, int(remaining * 1000))) if remaining > 0 else {}
            # Replies first: a worker that answered and then left (or a broker that did) must not cost the answer.
            for msg in self._receiver.replies(ready):
                if msg.header.get("rid") == rid:
                    self._receiver.dropped(ready)           # read the monitors' events all the same
                    return msg
                # a stale reply to an earlier attempt or an abandoned call: drop it
            if ready.get(self._mon) and self._events():
                return RECONNECTED
            if rid in self._receiver.dropped(ready):
                return RECONNECTED
            if remaining <= 0 or not ready:
                return None

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                if self._routes is not None:
                    self._routes.close()
                with contextlib.suppress(zmq.ZMQError):
                    self._sock.disable_monitor()
                self._mon.close(0)
                self._sock.close(0)
                self._sock = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            if self._sock is not None and os.getpid() == self._pid:
                if self._routes is not None:
                    self._routes.close()      # a client dropped without close() keeps no socket open per worker
                self._sock.close(0)
