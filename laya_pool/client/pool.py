"""Talking to a laya-pool: `Client` (blocking), `AsyncClient` (asyncio) and `local_pool` (a pool for a `with`).

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

The two clients share everything but the socket: the retry rules are `client.retry.Attempts` (no I/O),
and each API call (`forward`, `predict`, `describe`, `status`, `drain`, `ping`) is written once as a
plan, a generator that yields the pool calls it needs and gets their answers back. `Client` runs a plan
with blocking calls, `AsyncClient` with awaited ones.

The model card (tokenizer and config) comes from the pool with a describe call, so a client needs no
files. This module imports neither torch nor anything from the worker or broker packages.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from laya_pool.protocol import contract, settings, wire
from laya_pool.protocol.contract import Reason, WorkerState
from laya_pool.protocol.qtypes import QUESTION_TYPES
from laya_pool.protocol.wire import Cmd

from . import batching, scan
from .abstain import apply_confidence_gate, check_min_confidence
from .card import CardError
from .decode import decode_answers
from .direct import RETRY_S, ROUTES_TIMEOUT_S, Routes
from .direct_async import AsyncRoutes
from .errors import (
    BadModelCard,
    MalformedReply,
    PoolBusy,
    PoolError,
    PoolNoWorker,
    PoolTimeout,
    PoolUnavailable,
    PoolUnreachable,
    RequestFailed,
)
from .flights import Flights
from .plans import Await, Call, Many, NeedCard, Plan, T, header_only, starter
from .reader import Reader
from .receiver import Receiver
from .retry import Action, Attempts, RetryPolicy, Step, reply_error
from .semantics import encode_request
from .state import in_background
from .watch import EVENTS, RECONNECTED, ConnectionWatch

__all__ = ["Client", "AsyncClient", "ForwardResult", "LocalPool", "local_pool", "PoolError", "RequestFailed",
           "PoolUnavailable", "PoolBusy", "PoolNoWorker", "PoolUnreachable", "PoolTimeout", "MalformedReply",
           "BadModelCard", "configure_curve_client"]

DEFAULT_ENDPOINT = contract.default_frontend()
MAX_FRAME_BYTES = contract.MAX_FRONTEND_BYTES      # the broker's default frontend MAXMSGSIZE

log = logging.getLogger("laya-pool.client")
# Requests of one predict_batch in flight at once (AsyncClient): each is a full-capacity batch, so a few keep
# every worker busy, while a batch of thousands of states neither fills the broker's queue (shared by every
# client; a full one answers "busy") nor waits so long behind itself that its own requests time out.
BATCH_IN_FLIGHT = 16


@dataclass
class ForwardResult:
    """Logits per row (float32 arrays, one logit per option marker) and act probabilities [R, n_act].

    Unpacks as a pair: `logits, act = client.forward(rows)`.
    """
    logits: list[np.ndarray]
    act: np.ndarray
    flat: np.ndarray                 # all logits back to back, rows in order (float32 [M])
    worker: str | None = None
    fingerprint: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    taps: dict[str, np.ndarray] | None = None
    attempts: int = 1

    def __iter__(self) -> Iterator[Any]:
        return iter((self.logits, self.act))




def configure_curve_client(sock: zmq.Socket, keys: str | os.PathLike, role: str = "client") -> None:
    """Make `sock` a CURVE client with the key directory `laya-pool keys --out DIR` wrote (`role` "operator":
    the operator key pair, which may drain and restart workers)."""
    try:
        wire.configure_curve_client(sock, keys, role)
    except FileNotFoundError as e:
        raise PoolError(str(e)) from e


def _feed_events(watch: ConnectionWatch, mon: zmq.Socket) -> bool:
    """Feed `watch` the monitor events waiting on `mon` (never blocks); True if the connection came back
    after a drop. Both clients read their monitor through this, so they judge a connection alike."""
    back = False
    while True:
        try:
            ev = recv_monitor_message(mon, zmq.NOBLOCK)
        except zmq.Again:
            return back
        back = watch.feed(int(ev["event"])) or back


def _check_outputs(reply: wire.Reply, counts: np.ndarray) -> None:
    """An ok reply's logits and act match the request's rows (`counts`: each row's markers)."""
    if reply.logits is None or reply.act is None:
        raise MalformedReply("reply", "an ok reply without logits")
    sizes = counts.tolist()
    markers, rows = sum(sizes), len(sizes)
    if reply.logits.shape[0] != markers or reply.act.shape[0] != rows:
        raise MalformedReply("reply", f"{reply.logits.shape[0]} logits and {reply.act.shape[0]} act rows "
                                      f"for a request of {markers} markers in {rows} rows")


def _split_rows(flat: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    """`flat` cut into rows of `counts` logits, each its own copy. By slices at Python ints: `np.split` took 4 us for
    one row on the development CPU, most of the client's work on a reply."""
    out, at = [], 0
    for n in counts:
        out.append(flat[at:at + n].copy())
        at += n
    return out


class _as_pool_errors:  # noqa: N801 - used as `with _as_pool_errors():`, as the function it was
    """What a call raises is a PoolError: a reply that breaks the protocol, a card that cannot be used. (A class: every
    call enters it, 0.2 us where a contextlib generator took 0.75 on the development CPU.)"""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, e: BaseException | None, tb: Any) -> bool:
        if e is None or isinstance(e, PoolError):
            return False
        if isinstance(e, wire.ProtocolError):
            raise MalformedReply(e.field, e.message) from e
        if isinstance(e, CardError):
            raise BadModelCard(str(e)) from e
        return False


class _Base:
    """What the blocking and the asyncio clients share: the plans, request building, reply interpretation."""

    def __init__(self, endpoint: str | Sequence[str] | None, timeout: float, retries: int, backoff: float,
                 max_backoff: float, keys: str | None, connect_timeout: float = contract.CONNECT_TIMEOUT_S,
                 max_state_bytes: int | None = None):
        settings.warn_undeclared(log)          # a misspelt LAYA_* variable: once per process
        if isinstance(endpoint, (list, tuple)):     # one pool in a list (several: client/pools.py)
            if len(endpoint) != 1:
                raise ValueError(f"endpoint: give one endpoint or a list of them, got {endpoint!r}")
            endpoint = endpoint[0]
        self.endpoint = endpoint or DEFAULT_ENDPOINT
        if timeout <= 0 or retries < 0 or connect_timeout <= 0:
            raise ValueError("timeout and connect_timeout must be positive and retries non-negative")
        # The largest state's text a call takes (refused at once above it, RequestFailed naming `state`).
        self.max_state_bytes = (settings.get("LAYA_POOL_MAX_STATE_BYTES") if max_state_bytes is None
                                else int(max_state_bytes))
        if self.max_state_bytes <= 0:
            raise ValueError(f"max_state_bytes must be positive, got {self.max_state_bytes}")
        self.timeout, self.retries, self.backoff, self.max_backoff = timeout, retries, backoff, max_backoff
        self.connect_timeout = connect_timeout
        self.keys = keys
        self.max_frame_bytes = MAX_FRAME_BYTES
        self.cid = uuid.uuid4().hex
        self._rids = itertools.count(1)
        self._card_dict: dict[str, Any] | None = None
        self._card: Any = None
        self.operator: str | None = None     # the pool's operator secret, sent with drain (broker.operator)
        self.capacity: dict[str, int] = {}   # the largest request the pool takes (with the model card)
        self._policy: tuple[tuple, RetryPolicy] | None = None     # `_attempts`: the last call's settings, its policy
        self.key_role = "client"             # "operator": connect with the operator CURVE key pair
        # laya.load's decoding options: lang_temperatures (resolved per card) and a calibration file
        self._lang_raw: dict[str, Any] | None = None
        self._lang_resolved: tuple[Any, dict[str, Any]] | None = None
        self._calibration: Any = None

    def _socket(self, ctx: zmq.Context) -> tuple[zmq.Socket, zmq.Socket]:
        """The DEALER, connected, and its monitor (ConnectionWatch's events)."""
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 500)      # a restarted broker is found within half a second
        s.setsockopt(zmq.MAXMSGSIZE, wire.MAX_BODY_BYTES + wire.MAX_HEADER_BYTES)
        if self.keys:
            configure_curve_client(s, self.keys, self.key_role)
        # The monitor before the connect: a refused handshake happens within milliseconds and is not retried,
        # so a monitor attached after it would never tell the call why it gets no answer.
        mon = s.get_monitor_socket(EVENTS)
        s.connect(self.endpoint)
        return s, mon

    def _attempts(self, timeout: float | None, retries: int | None, started: float | None) -> Attempts:
        key = (self.timeout if timeout is None else timeout, self.retries if retries is None else retries,
               self.backoff, self.max_backoff, self.connect_timeout)
        # The policy (a frozen dataclass: 1.5 us to build) is made again only when the settings differ from the
        # last call's, as they rarely do.
        cached = self._policy           # (read once: another thread's call may replace it meanwhile)
        if cached is None or cached[0] != key:
            cached = self._policy = (key, RetryPolicy(*key))
        return Attempts(cached[1], started=started)

    def _tokenizing_timeout(self, timeout: float | None) -> PoolTimeout:
        t = self.timeout if timeout is None else timeout
        return PoolTimeout(f"{self.endpoint}: the call's deadline of {t:g} s passed while this client tokenized the "
                           "state", last="tokenizing", reason=Reason.TIMEOUT)

    def _left(self, timeout: float | None, started: float) -> float:
        """What is left of a call's deadline (`timeout` from `started`), for a step that is a call of its own."""
        return max(1e-3, (self.timeout if timeout is None else timeout) - (time.monotonic() - started))

    # -- plans: each API call written once; the drivers run them -------------------------------------------
    def _forward_plan(self, rows: Sequence[tuple[Any, Any, int]], timeout: float | None, retries: int | None,
                      worker: str | None, mode: str | None, taps: bool) -> Plan[ForwardResult]:
        reply, counts, attempts = yield from self._reply_plan(rows, timeout, retries, worker, mode, taps)
        return self._forward_result(reply, counts, attempts)

    def _reply_plan(self, rows: Sequence[tuple[Any, Any, int]], timeout: float | None, retries: int | None,
                    worker: str | None, mode: str | None, taps: bool = False,
                    on_sent: Callable[[], None] | None = None) -> Plan[tuple[wire.Reply, np.ndarray, int]]:
        """One request of `rows`: its ok reply, logits and act matching the rows (read-only arrays over the reply's
        buffers), the rows' marker counts and the attempts it took."""
        arrays = self._pack(rows)
        self._check_fits(len(arrays["lengths"]), len(arrays["ids"]), len(arrays["markers"]), "rows")
        msg, attempts = yield Call(Cmd.REQUEST, self._request_frames(arrays, worker, mode, taps), timeout, retries,
                                    on_sent, direct=worker is None)
        reply = wire.parse_reply(msg)
        if reply.status == wire.STATUS_FINAL:
            self._raise_final(reply)
        _check_outputs(reply, arrays["marker_counts"])
        return reply, arrays["marker_counts"], attempts

    def _predict_plan(self, state: Any, questions: dict[Any, Any], timeout: float | None, retries: int | None,
                      max_len: int | None, head_max_len: int | None, worker: str | None,
                      mode: str | None, lang: str | None = None, min_confidence: Any = None) -> Plan[dict[str, Any]]:
        # The SDK's system_one is predict_batch of one state: so is ours.
        results = yield from self._predict_batch_plan([state], questions, lang, max_len, head_max_len, min_confidence,
                                                      None, timeout, retries, worker, mode)
        return results[0]

    def _describe_plan(self, timeout: float | None, refresh: bool) -> Plan[dict[str, Any]]:
        if self._card_dict is None or refresh:
            msg, _ = yield Call(Cmd.DESCRIBE, lambda rid, cid: wire.encode(Cmd.DESCRIBE, {"rid": rid, "cid": cid}),
                                 timeout)
            self._set_card(self._body(msg))
            cap = msg.header.get("capacity")
            self.capacity = {k: v for k, v in cap.items() if isinstance(v, int)} if isinstance(cap, dict) else {}
        return self._card_dict

    def _status_plan(self, timeout: float | None, retries: int | None) -> Plan[dict[str, Any]]:
        msg, _ = yield Call(Cmd.STATUS, header_only(Cmd.STATUS), timeout, retries)
        return self._body(msg)

    def _drain_plan(self, worker: str, restart: bool, timeout: float | None) -> Plan[dict[str, Any]]:
        # Not retried: a drain is an operator's one-off, and a repeated one would find the worker draining.
        op = {"op": self.operator} if self.operator else {}
        msg, _ = yield Call(Cmd.DRAIN, header_only(Cmd.DRAIN, worker=str(worker), restart=bool(restart), **op),
                             timeout, 0)
        return self._body(msg)

    def _reload_plan(self, model: str, fingerprint: str, reload_id: str,
                     timeout: float | None) -> Plan[dict[str, Any]]:
        op = {"op": self.operator} if self.operator else {}
        msg, _ = yield Call(Cmd.RELOAD, header_only(Cmd.RELOAD, model=str(model), fingerprint=str(fingerprint),
                                                      id=str(reload_id), **op), timeout, 0)
        return self._body(msg)

    def _ping_plan(self, timeout: float | None) -> Plan[float]:
        t = time.perf_counter()
        yield Call(Cmd.HEARTBEAT, header_only(Cmd.HEARTBEAT), timeout, 0)
        return time.perf_counter() - t

    # -- the SDK's inference API (laya.Agent's predict_batch, predict_long, decide, decide_batch) -----------
    def _predict_batch_plan(self, states: Any, questions: dict[Any, Any], lang: str | None, max_len: int | None,
                            head_max_len: int | None, min_confidence: Any, batch_size: int | None,
                            timeout: float | None, retries: int | None, worker: str | None,
                            mode: str | None) -> Plan[list[dict[str, Any]]]:
        # The SDK's checks, in its order: the threshold, the states, the questions.
        threshold = check_min_confidence(min_confidence) if min_confidence is not None else None
        states = batching.check_states(states, questions)
        if not states:
            return []
        if not questions:
            results = [batching.empty_result() for _ in states]
        else:
            # (the driver's answer to NeedCard, without the round trip once the card is here)
            card = self._card if self._card is not None else (yield NeedCard(timeout))
            results = yield from self._answer_states(card, states, questions, lang, max_len, head_max_len, batch_size,
                                                     timeout, retries, worker, mode)
        apply_confidence_gate(results, threshold)
        return results

    def _answer_states(self, card: Any, states: list[Any], questions: dict[Any, Any], lang: str | None,
                       max_len: int | None, head_max_len: int | None, batch_size: int | None, timeout: float | None,
                       retries: int | None, worker: str | None, mode: str | None) -> Plan[list[dict[str, Any]]]:
        """Every state's rows, packed whole into as few requests as the pool's capacity allows (client/batching.py),
        sent together; each state's answers decoded from its share of the replies."""
        encoded: list[Any] = []
        try:
            results = yield from self._answer_encoded(card, states, questions, lang, max_len, head_max_len,
                                                      batch_size, timeout, retries, worker, mode, encoded)
        finally:
            for e in encoded:        # a call that ended early stops its states' counts (no-ops once they are done)
                e.state.cancel()
        return results

    def _answer_encoded(self, card: Any, states: list[Any], questions: dict[Any, Any], lang: str | None,
                        max_len: int | None, head_max_len: int | None, batch_size: int | None, timeout: float | None,
                        retries: int | None, worker: str | None, mode: str | None,
                        encoded: list[Any]) -> Plan[list[dict[str, Any]]]:
        """`_answer_states`, with the states' encodings kept in `encoded` as they are made."""
        for refreshed in (False, True):
            encoded[:] = []
            for i, state in enumerate(states):
                encoded.append(self._encode(card, state, questions, max_len, head_max_len, row=i if len(states) > 1
                                            else None))
            for e in encoded:
                self._check_fits(len(e.rows), e.n_tokens, e.n_markers, "questions")
            # A pool that did not say its capacity (no worker was ready when it described itself) still gets
            # requests within the frame limit rather than one the client must refuse: a request's one buffer holds at
            # most 5 int32 a token (a row has a token or more, a marker is a token's position).
            capacity = {"max_tokens": self.max_frame_bytes // 20, **self.capacity}
            chunks = batching.pack([(len(e.rows), e.n_tokens, e.n_markers) for e in encoded], capacity, batch_size)

            # The whole states' counts (usage) are tokenized while the pool computes.
            plans = [self._reply_plan([row for i in chunk for row in encoded[i].rows], timeout, retries, worker, mode,
                                      False, starter([encoded[i] for i in chunk])) for chunk in chunks]
            # One request (every predict's) runs inside this plan: a Many of one would take a driver of its own.
            replies = [(yield from plans[0])] if len(plans) == 1 else (yield Many(plans))
            outputs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
            for chunk, (reply, _, _) in zip(chunks, replies):
                parts = batching.split_outputs(reply.logits, reply.act, [encoded[i].n_markers for i in chunk],
                                               [len(encoded[i].rows) for i in chunk])
                outputs.update(zip(chunk, parts))
            served = {reply.fingerprint for reply, _, _ in replies}
            for i, e in enumerate(encoded):
                pending = e.state.pending()
                if pending is not None:
                    yield Await(pending, timeout)
                if not e.state.window_agrees():
                    # The state window (client/state.py) disagrees with the whole state's tokens, which its
                    # argument says cannot happen: answer from rows built from the whole state, and say so.
                    log.warning("state window disagreed with the whole state's tokens; re-sent with the whole state")
                    encoded[i] = e = self._encode(card, states[i], questions, max_len, head_max_len, window=False)
                    reply, _, _ = yield from self._reply_plan(e.rows, timeout, retries, worker, mode)
                    outputs[i] = (reply.logits, reply.act)
                    served.add(reply.fingerprint)
            stale = sorted(f for f in served if f is not None and card.fingerprint and f != card.fingerprint)
            if not stale:
                langs = self._lang_temperatures(card)
                return [self._decode(card, e, *outputs[i], lang, langs, self._calibration)
                        for i, e in enumerate(encoded)]
            if refreshed:
                break
            card = yield NeedCard(timeout, refresh=True)   # the pool now serves another model
        raise PoolError(f"the pool answered with model {stale[0][:12]} but describes {card.fingerprint[:12]}")

    def _predict_long_plan(self, state: Any, questions: dict[Any, Any], window: int | None, stride: int | None,
                           aggregate: str, batch_size: int | None, lang: str | None, timeout: float | None,
                           retries: int | None, worker: str | None, mode: str | None) -> Plan[dict[str, Any]]:
        from . import semantics, text

        if state is None:
            raise TypeError("state must not be None; pass a string, dict, or list")
        if not isinstance(questions, dict):
            raise TypeError(f"questions must be a dict of question id -> definition, got {type(questions).__name__}")
        if aggregate != "auto":
            raise ValueError("predict_long: only aggregate='auto' is supported")
        for qid in questions:
            semantics.check_question(qid, questions[qid])
        internal = {qid: semantics.to_internal(questions[qid]) for qid in questions}
        card = yield NeedCard(timeout)
        budget, step, room = scan.window_budget(card, list(internal.values()), card.max_len, card.head_max_len,
                                                window, stride)
        try:
            serialized = semantics.serialize_state(state)
        except (TypeError, ValueError) as e:      # bytes or lone surrogates: say where (client/text.py)
            raise text.state_error(state, e) from e
        semantics.check_state_size(state, serialized, self.max_state_bytes)

        def tokenize() -> list[int]:
            try:
                return card.encode(serialized.replace(card.mask_token, " "))
            except (TypeError, ValueError) as e:
                raise text.state_error(state, e) from e
        # The whole document is tokenized (the windows are cut from its ids) off the caller's thread, so
        # AsyncClient's event loop goes on meanwhile.
        state_ids = yield Await(in_background(tokenize), timeout)
        if len(state_ids) <= (budget if window and window > 0 else room):
            # It fits one row: the plain answer, read whole.
            single = dict((yield from self._predict_plan(state, questions, timeout, retries, None, None, worker, mode,
                                                         lang)))
            single["usage"] = {**(single.get("usage") or {}), "windows": 1}
            return single
        starts = scan.window_starts(len(state_ids), budget, step)
        windows = [card.decode(state_ids[i:i + budget]) for i in starts]
        cap = scan.window_batch_cap(len(windows), budget, scan.default_window(card.max_len, card.head_max_len),
                                    batch_size)
        results = yield from self._predict_batch_plan(windows, questions, lang, None, None, None, cap, timeout, retries,
                                                      worker, mode)
        return scan.aggregate_windows(results, {qid: q["t"] for qid, q in internal.items()}, starts, budget,
                                      len(state_ids))

    def _decide_plan(self, state: Any, schema: Any, questions: Any, return_details: bool, min_confidence: Any,
                     lang: str | None, max_len: int | None, head_max_len: int | None, timeout: float | None,
                     retries: int | None, worker: str | None, mode: str | None) -> Plan[Any]:
        from .structured import Decision

        decision = Decision.plan(schema, questions, min_confidence, return_details)
        result = yield from self._predict_plan(state, decision.questions, timeout, retries, max_len, head_max_len,
                                               worker, mode, lang, decision.min_confidence)
        return decision.read(result)

    def _decide_batch_plan(self, states: Any, schema: Any, questions: Any, return_details: bool,
                           min_confidence: Any, batch_size: int | None, lang: str | None, max_len: int | None,
                           head_max_len: int | None, timeout: float | None, retries: int | None,
                           worker: str | None, mode: str | None) -> Plan[list[Any]]:
        from .structured import Decision

        decision = Decision.plan(schema, questions, min_confidence, return_details, batch=states)
        results = yield from self._predict_batch_plan(list(states), decision.questions, lang, max_len, head_max_len,
                                                      None, batch_size, timeout, retries, worker, mode)
        return [decision.read(r) for r in results]

    def _lang_temperatures(self, card: Any) -> dict[str, Any]:
        """laya.load's `lang_temperatures`, resolved against this card's temperatures (an override without
        `temperature` inherits the checkpoint's); the first time for a card, a calibration file is checked
        against its config."""
        if self._lang_resolved is None or self._lang_resolved[0] is not card:
            from .decode import resolve_lang_temperatures
            if self._calibration is not None:
                self._calibration.check_fits(card.config)
            base = card.config.get("temperature", [1.0] * len(QUESTION_TYPES))
            self._lang_resolved = (card, resolve_lang_temperatures(self._lang_raw, base))
        return self._lang_resolved[1]

    def _set_decoding(self, lang_temperatures: dict[str, Any] | None, calibration: Any) -> None:
        # Malformed options are refused now, as laya.load refuses them, not at the first answer.
        if lang_temperatures is not None:
            import warnings

            from .decode import resolve_lang_temperatures
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")        # the clamping warnings come with the card's own values
                resolve_lang_temperatures(lang_temperatures, [1.0] * len(QUESTION_TYPES))
        if calibration is not None:
            from .calibration import load_calibration
            calibration = load_calibration(calibration)
        self._lang_raw, self._lang_resolved, self._calibration = lang_temperatures, None, calibration

    # -- what the plans use -------------------------------------------------------------------------------
    def _check_fits(self, rows: int, tokens: int, markers: int, field: str) -> None:
        """Refuse, before sending, a request larger than the pool's capacity (known from the model card)."""
        c = self.capacity
        what = "questions (one row each)" if field == "questions" else "rows"
        for have, key, unit in ((rows, "max_rows", what), (tokens, "max_tokens", "tokens"),
                                (markers, "max_markers", "option markers")):
            if key in c and have > c[key]:
                hint = ("; the state is repeated in every question's row, so split the questions over several "
                        "predict calls" if field == "questions" else "; split the rows over several calls")
                raise RequestFailed(f"{field}: {have} {unit} exceed the pool's limit of {c[key]} per request "
                                    f"({key}){hint}", field=field, reason=Reason.TOO_LARGE)

    @staticmethod
    def _pack(rows: Sequence[tuple[Any, Any, int]]) -> dict[str, np.ndarray]:
        try:
            return wire.pack_rows(rows)
        except wire.ProtocolError as e:       # the caller's rows, not the pool's reply
            raise RequestFailed(str(e), field=e.field) from e

    def _request_frames(self, arrays: dict[str, Any], worker: str | None, mode: str | None,
                        taps: bool) -> Callable[[int, str], list[Any]]:
        n = wire.request_bytes(*(int(np.asarray(arrays[name]).size) for name in ("lengths", "ids", "markers")))
        if n > self.max_frame_bytes:
            # The broker's MAXMSGSIZE would drop the connection without a word: refuse it here instead.
            raise RequestFailed(f"{wire.ARRAYS}: {n} bytes exceed the {self.max_frame_bytes}-byte frame limit",
                                field=wire.ARRAYS, reason=Reason.TOO_LARGE)

        def build(rid: int, cid: str) -> list[Any]:
            return wire.encode_request(rid, arrays, cid=cid, worker=worker, mode=mode, taps=taps)
        return build

    @staticmethod
    def _forward_result(reply: wire.Reply, counts: np.ndarray, attempts: int) -> ForwardResult:
        """A checked reply (`_reply_plan`) as the caller's own arrays."""
        flat = np.array(reply.logits, dtype=np.float32)
        return ForwardResult(logits=_split_rows(flat, counts.tolist()), act=np.array(reply.act, dtype=np.float32),
                             flat=flat, worker=reply.worker, fingerprint=reply.fingerprint, metrics=reply.metrics,
                             taps=None if reply.taps is None else {k: np.array(v) for k, v in reply.taps.items()},
                             attempts=attempts)

    @staticmethod
    def _raise_final(reply: wire.Reply) -> None:
        err = reply.error or {}
        raise RequestFailed(err.get("message", "request refused"), field=err.get("field"), row=err.get("row"),
                            worker=reply.worker, reason=err.get("reason"))

    def _body(self, msg: wire.Message) -> Any:
        reply = wire.parse_any_reply(msg)
        if reply.status == wire.STATUS_FINAL:
            self._raise_final(reply)
        return wire.body_of(msg)

    def _set_card(self, card: dict[str, Any]) -> Any:
        from .card import ModelCard

        if not isinstance(card, dict):
            raise wire.ProtocolError("body", f"a model card is a map, got {type(card).__name__}")
        self._card_dict, self._card = card, ModelCard.from_card(card)
        return self._card

    def _encode(self, card: Any, state: Any, questions: dict, max_len: int | None, head_max_len: int | None,
                window: bool = True, row: int | None = None) -> Any:
        """The state's rows (semantics.encode_request); `row`: its place among a batch's states, for an error."""
        try:
            return encode_request(card, state, questions, max_len=max_len, head_max_len=head_max_len, window=window,
                                  max_state_bytes=self.max_state_bytes)
        except RequestFailed as e:
            if e.row is None:
                e.row = row
            raise

    @staticmethod
    def _decode(card: Any, encoded: Any, flat: np.ndarray, act: np.ndarray, lang: str | None = None,
                lang_temperatures: dict[str, Any] | None = None, calibration: Any = None) -> dict[str, Any]:
        return decode_answers(card, encoded, flat, act, lang, lang_temperatures, calibration)


def _several(endpoint: Any) -> bool:
    """`Client(endpoint)` is a client of several pools (client/pools.py)."""
    return isinstance(endpoint, (list, tuple)) and len(endpoint) > 1


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


# ---------------------------------------------------------------------------------------------- local pool

@dataclass
class LocalPool:
    endpoint: str
    process: subprocess.Popen
    log_path: Path | None
    keys: str | None = None

    def client(self, **kwargs: Any) -> Client:
        return Client(self.endpoint, keys=self.keys, **kwargs)

    def status(self) -> dict[str, Any]:
        with self.client(timeout=5.0, retries=1) as c:
            return c.status()

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor (it drains and stops everything); SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


@contextlib.contextmanager
def local_pool(model_dir: str | os.PathLike, devices: str = "cpu", *, workers_per_device: int = 1,
               frontend: str | None = None, heartbeat_ms: int | None = None, liveness: int | None = None,
               startup_timeout: float = 180.0, log: str | os.PathLike | None = None, keys: str | None = None,
               extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[LocalPool]:
    """Start a pool (`laya-pool up` as a subprocess) for the life of a `with` block.

    Returns once every worker has registered. The endpoints default to ipc sockets in a private
    temporary directory. `log` is a file for the pool's output (default: a file in that directory,
    read with `pool.log()`). With `keys` (a `laya-pool keys` directory) everything speaks CURVE."""
    tmp = Path(tempfile.mkdtemp(prefix="laya-pool-"))
    os.chmod(tmp, 0o700)
    frontend = frontend or f"ipc://{tmp}/frontend"
    cmd = [sys.executable, "-m", "laya_pool", "up", "--model", str(model_dir), "--devices", devices,
           "--workers-per-device", str(workers_per_device), "--frontend", frontend, "--backend", f"ipc://{tmp}/backend"]
    for flag, value in (("--heartbeat-ms", heartbeat_ms), ("--liveness", liveness), ("--keys", keys)):
        if value is not None:
            cmd += [flag, str(value)]
    log_path = Path(log) if log is not None else tmp / "pool.log"
    pool = LocalPool(frontend, _spawn([*cmd, *extra_args], log_path, env), log_path,
                     keys=None if keys is None else str(keys))
    failed = True
    try:
        n_workers = len([d for d in devices.split(",") if d.strip()]) * workers_per_device
        _wait_for_workers(pool, n_workers, startup_timeout)
        yield pool
        failed = False
    finally:
        pool.stop()
        # The private directory goes away with the pool; its log stays when something went wrong.
        for p in tmp.iterdir():
            if p != log_path or not failed:
                with contextlib.suppress(OSError):
                    p.unlink()
        with contextlib.suppress(OSError):
            tmp.rmdir()


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    """`cmd` in its own session, a checkout first on PYTHONPATH, its output appended to `log_path`."""
    full_env = dict(os.environ)
    # Where this package lies (a checkout's root, or site-packages, where the child finds it by itself).
    home = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parents[1]
    if home.name not in ("site-packages", "dist-packages"):
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(home), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)


def _wait_for_workers(pool: LocalPool, n_workers: int, timeout: float) -> None:
    """Until `n_workers` are ready; PoolError (with the log's tail) if the pool exits or time runs out."""
    deadline = time.monotonic() + timeout
    with pool.client(timeout=2.0, retries=0) as c:
        while True:
            if pool.process.poll() is not None:
                raise PoolError(f"the pool exited with code {pool.process.returncode} while starting "
                                f"(log: {pool.log_path}):\n{pool.log()[-4000:]}")
            try:
                if sum(1 for w in c.status()["workers"] if w["state"] == WorkerState.READY) >= n_workers:
                    return
            except PoolUnavailable:
                pass
            if time.monotonic() > deadline:
                raise PoolError(f"the pool did not get {n_workers} workers ready within {timeout:g} s "
                                f"(log: {pool.log_path}):\n{pool.log()[-4000:]}")
            time.sleep(0.2)
