"""What `Client` (client/pool.py) and `AsyncClient` (client/pool_async.py) share: every API call written once as a
plan (client/plans.py: a generator that yields the pool calls it needs and gets their answers back), the request
frames, the checks of a reply and the model card. A client runs a plan with blocking calls or with awaited ones; the
retry rules are client/retry.py's. This module imports neither torch nor anything from the worker or broker packages.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq
from zmq.utils.monitor import recv_monitor_message

from laya_pool.protocol import contract, settings, wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.qtypes import QUESTION_TYPES
from laya_pool.protocol.wire import Cmd

from . import batching, scan
from .abstain import apply_confidence_gate, check_min_confidence
from .card import CardError
from .decode import decode_answers
from .errors import (
    BadModelCard,
    MalformedReply,
    PoolError,
    PoolTimeout,
    RequestFailed,
)
from .plans import Await, Call, Many, NeedCard, Plan, header_only, starter
from .retry import Attempts, RetryPolicy
from .semantics import encode_request
from .state import in_background
from .watch import EVENTS, ConnectionWatch

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

    def _card_plan(self, timeout: float | None) -> Plan[Any]:
        """The model card: the one this client holds, else the driver's answer to NeedCard (a describe call). Held, it
        costs no step through the driver (a predict asks for it every call)."""
        if self._card is not None:
            return self._card
        return (yield NeedCard(timeout))

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
            card = yield from self._card_plan(timeout)
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
        card = yield from self._card_plan(timeout)
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
