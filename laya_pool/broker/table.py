"""The broker's worker table: who is registered, on which device, with which model, capacity, credit and state.

Pure bookkeeping, no sockets: `admit` checks a READY and makes its row, `add` puts it in (deciding whether the
worker serves the pool's model), and the questions the rest of the broker asks of it are here: which workers serve
the pool's model (`serving`), which may be sent a request now (`free`), the largest request one takes (`capacity`),
the direct routes clients may use (`routes`), and, during a reload, when the pool serves the new model
(`switch_model`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from laya_pool.protocol import wire
from laya_pool.protocol.contract import WorkerState

from .config import BrokerConfig

log = logging.getLogger("laya-pool.broker")

CAPACITY = ("max_tokens", "max_rows", "max_markers")


@dataclass
class WorkerInfo:
    id: str
    identity: bytes
    data: bytes | None = None           # the worker's data socket: its replies come from there
    data_requests: bool = False         # ... and its requests go there (once it is connected)
    direct: str | None = None           # where clients may send it requests themselves (loopback without keys)
    direct_key: str = ""                # ... and that socket's CURVE public key (z85), with keys
    host: str = "?"
    device: str = "?"
    fingerprint: str = ""
    capacity: dict[str, int] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)
    credit: int = 1
    pid: int | None = None
    mode: str | None = None
    generation: int = 0
    state: WorkerState = WorkerState.READY
    inflight: set[int] = field(default_factory=set)
    expiry: float = 0.0
    last_sent: float = 0.0
    last_seen: float = 0.0
    last_dispatch: float = 0.0
    since: float = 0.0
    registrations: int = 0
    completed: int = 0
    failed: int = 0
    lost: int = 0
    drain_restart: bool = False
    restart_requested: bool = False     # restart-worker on a worker that is down: the supervisor starts it
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # The capacity as three ints, read once: every request is measured against it twice (refuse, pick).
        c = self.capacity
        self._bounds = (c.get("max_tokens", 1 << 62), c.get("max_rows", 1 << 62), c.get("max_markers", 1 << 62))

    def fits(self, req: wire.RequestHead) -> bool:
        tokens, rows, markers = self._bounds
        return req.tokens <= tokens and req.rows <= rows and req.n_markers <= markers

    def row(self, now: float) -> dict[str, Any]:
        return {"id": self.id, "device": self.device, "state": self.state, "pid": self.pid,
                "fingerprint": self.fingerprint, "mode": self.mode, "capacity": self.capacity,
                "credit": self.credit, "inflight": len(self.inflight), "completed": self.completed,
                "failed": self.failed, "lost": self.lost, "registrations": self.registrations,
                "generation": self.generation, "restart_requested": self.restart_requested, "direct": self.direct,
                "up_s": round(now - self.since, 3),
                "last_seen_ms": round((now - self.last_seen) * 1e3, 1), "stats": self.stats}


class WorkerTable:
    def __init__(self, cfg: BrokerConfig):
        self.cfg = cfg
        self.workers: dict[str, WorkerInfo] = {}
        self.by_identity: dict[bytes, str] = {}     # control and data socket identities -> worker id
        self.pool_fp: str | None = cfg.fingerprint or None
        self.reload: dict[str, str] | None = None     # the latest `laya-pool reload`, for the supervisor (status)
        self.cards: dict[str, Any] = {}   # fingerprint -> the card body frame, one buffer shared by all sends

    def of(self, identity: bytes) -> WorkerInfo | None:
        """The worker a message came from (by its control or data socket), if registered."""
        wid = self.by_identity.get(identity)
        return self.workers.get(wid) if wid is not None else None

    # -------------------------------------------------------------------------------------------- registration

    def admit(self, identity: bytes, h: dict[str, Any], now: float, expiry_s: float) -> WorkerInfo:
        """A READY's header checked and made a row (not yet in the table: `add`); a registration again keeps the
        worker's history. Raises wire.ProtocolError, naming the field, before anything changes."""
        wid = wire.get(h, "id", str)
        if not wid or not wire.identity_of(wid, identity):
            raise wire.ProtocolError("id", f"the worker id {wid!r} must be its socket identity {identity!r} (or begin "
                                           "it, before '@' and the socket's own suffix)")
        if "/" in wid or "@" in wid:
            raise wire.ProtocolError("id", f"a worker id has no '/' or '@' (they name its sockets): {wid!r}")
        cap = wire.get(h, "capacity", dict)
        for k in CAPACITY:
            wire.get(cap, k, int, what="capacity")
        fp = wire.get(h, "fingerprint", str)
        data = wire.get(h, "data", str, default=None)
        if data is not None and not (data.endswith("/data") and wire.identity_of(wid, data[:-5].encode())):
            raise wire.ProtocolError("data", f"a worker's data socket is {wid + '[@...]/data'!r}, not {data!r}")
        direct, direct_key = self._direct(h)
        old = self.workers.get(wid)
        kept = {} if old is None else {"completed": old.completed, "failed": old.failed, "lost": old.lost,
                                       "registrations": old.registrations}      # a worker's history
        w = WorkerInfo(id=wid, identity=identity, data=None if data is None else data.encode(),
                       data_requests=data is not None and wire.get(h, "data_requests", bool, default=False),
                       direct=direct, direct_key=direct_key or "", host=wire.get(h, "host", str, default="?"),
                       device=wire.get(h, "device", str, default="?"), fingerprint=fp,
                       capacity={k: int(v) for k, v in cap.items() if isinstance(v, int)},
                       limits={k: int(v) for k, v in wire.get(h, "limits", dict, default={}).items()
                               if isinstance(v, int)},
                       credit=max(1, wire.get(h, "credit", int, default=1)),
                       pid=wire.get(h, "pid", int, default=None), mode=wire.get(h, "mode", str, default=None),
                       generation=wire.get(h, "generation", int, default=0), expiry=now + expiry_s,
                       last_seen=now, since=now, **kept)
        w.registrations += 1
        return w

    def _direct(self, h: dict[str, Any]) -> tuple[str | None, str | None]:
        """A READY's direct socket and its CURVE key, checked (a direct socket beyond loopback, or in a pool with
        keys, only with its key)."""
        direct = wire.get(h, "direct", str, default=None)
        direct_key = wire.get(h, "direct_key", str, default=None)
        if direct_key is not None and not wire.is_curve_key(direct_key):
            raise wire.ProtocolError("direct_key", "a CURVE public key in z85 (40 characters)")
        if direct is not None and self.cfg.keys and direct_key is None:
            raise wire.ProtocolError("direct_key", "a pool with keys needs the direct socket's CURVE key")
        if direct is not None and not wire.is_loopback(direct) and direct_key is None:
            raise wire.ProtocolError("direct", f"a direct socket beyond loopback needs CURVE (direct_key): {direct!r}")
        return direct, direct_key

    def add(self, w: WorkerInfo) -> None:
        """Put an admitted worker in, in place of an earlier registration of its id; one of another model than the
        pool's is MISMATCH (reached only by requests that name it)."""
        fp = w.fingerprint
        live_fps = {x.fingerprint for x in self.workers.values() if x.state.live and x.id != w.id}
        # A pool started for one model (`--fingerprint`, which `laya-pool up` passes) never changes model;
        # a bare broker follows the workers it has.
        if not self.cfg.fingerprint and (self.pool_fp is None or not live_fps or self.pool_fp not in live_fps):
            self.pool_fp = fp
        if fp != self.pool_fp and self.reload is not None and fp == self.reload["fingerprint"]:
            w.state = WorkerState.MISMATCH      # until switch_model serves the new model
            log.info("worker %s has the model of the reload (%s); the pool serves %s until enough workers have it",
                     w.id, fp[:12], self.pool_fp[:12])
        elif fp != self.pool_fp:
            w.state = WorkerState.MISMATCH
            log.error("worker %s serves model %s but the pool serves %s: not dispatching to it", w.id, fp[:12],
                      self.pool_fp[:12])
        old = self.workers.get(w.id)
        if old is not None:
            self.by_identity.pop(old.data, None)
        self.workers[w.id] = w
        self.by_identity[w.identity] = w.id
        if w.data is not None:
            self.by_identity[w.data] = w.id

    def forget(self, w: WorkerInfo) -> None:
        self.workers.pop(w.id, None)
        self.by_identity.pop(w.identity, None)
        self.by_identity.pop(w.data, None)

    def switch_model(self) -> bool:
        """During a reload, serve the new model once at least as many ready workers have it as have the old:
        a client whose answer comes from the new model fetches its card again (by the fingerprint), and
        the workers still on the old model wait, idle, for their turn. True when it switched."""
        r = self.reload
        if r is None or r["fingerprint"] == self.pool_fp:
            return False
        ready = [w for w in self.workers.values() if w.state in (WorkerState.READY, WorkerState.MISMATCH)]
        new = sum(w.fingerprint == r["fingerprint"] for w in ready)
        old = sum(w.fingerprint == self.pool_fp for w in ready)
        if new == 0 or new < old:
            return False
        log.info("serving model %s from now on (%d workers have it, %d still have %s)", r["fingerprint"][:12], new,
                 old, (self.pool_fp or "?")[:12])
        self.pool_fp = self.cfg.fingerprint = r["fingerprint"]
        for w in ready:
            w.state = WorkerState.READY if w.fingerprint == self.pool_fp else WorkerState.MISMATCH
        return True

    # -------------------------------------------------------------------------------------------- questions

    def serving(self) -> list[WorkerInfo]:
        """Ready workers of the pool's model."""
        return [w for w in self.workers.values() if w.state is WorkerState.READY and w.fingerprint == self.pool_fp]

    def free(self) -> list[WorkerInfo]:
        """Workers that may be sent a request now (credit left). A worker serving another model ("mismatch") only
        takes requests that name it (broker/dispatch.py `pick`): that is how compare_workers examines it, and
        ordinary traffic never lands there."""
        # Asked after every message the broker handles, so one pass with the states compared inline (the property
        # `WorkerState.dispatchable` called per worker cost a routed call ~25 us more broker CPU at 64 workers:
        # docs/decisions/0022-workers-on-many-hosts.md): a ready worker of the pool's model, or a mismatched one.
        fp, ready, mismatch = self.pool_fp, WorkerState.READY, WorkerState.MISMATCH
        return [w for w in self.workers.values() if len(w.inflight) < w.credit
                and ((w.state is ready and w.fingerprint == fp) or w.state is mismatch)]

    def capacity(self) -> dict[str, Any]:
        """`{"capacity": {...}}` for a describe reply: the largest request a ready worker takes (the worker
        `check_capacity` measures against), so a client refuses a larger one before sending it."""
        ready = self.serving()
        if not ready:
            return {}
        c = max(ready, key=lambda w: w.capacity.get("max_tokens", 0)).capacity
        return {"capacity": {k: c[k] for k in CAPACITY if k in c}}

    def check_capacity(self, req: wire.RequestHead) -> None:
        """A request larger than every ready worker can hold is refused now (final), naming what is too large."""
        if self._fits_a_ready_worker(req):
            return
        ready = self.serving()
        c = max(ready, key=lambda w: w.capacity.get("max_tokens", 0)).capacity
        for name, have, cap in (("ids", req.tokens, "max_tokens"), ("lengths", req.rows, "max_rows"),
                                ("markers", req.n_markers, "max_markers")):
            if have > c.get(cap, 1 << 62):
                raise wire.ProtocolError(name, f"{have} exceeds every worker's capacity ({cap} {c[cap]})")
        raise wire.ProtocolError("ids", "the request fits no worker's capacity")

    def _fits_a_ready_worker(self, req: wire.RequestHead) -> bool:
        """True when a ready worker of the pool's model can hold `req`, or when there is none to judge by."""
        ready = False
        for w in self.workers.values():
            if w.state is WorkerState.READY and w.fingerprint == self.pool_fp:
                if w.fits(req):
                    return True
                ready = True
        return not ready

    def routes(self) -> list[list[str]]:
        """[worker id, direct endpoint, host, CURVE key] of each ready worker of the pool's model that takes clients'
        requests itself (docs/architecture.md, "The data path"): a client may send them there, and comes back here
        when that fails. Without keys the endpoints are loopback, of use on the worker's own host only, and the row
        has no key (three columns, as clients before keyed routes read it); with keys the client authenticates the
        worker by that key, wherever it is."""
        return [[w.id, w.direct, w.host, *([w.direct_key] if w.direct_key else [])] for w in self.workers.values()
                if w.direct and w.state is WorkerState.READY and w.fingerprint == self.pool_fp]

    def rows(self, now: float) -> list[dict[str, Any]]:
        """The status rows, in the workers' natural order (2 before 10)."""
        return [w.row(now) for w in sorted(self.workers.values(), key=lambda w: _natural(w.id))]


def _natural(s: str) -> tuple:
    return (0, int(s), "") if s.isdigit() else (1, 0, s)
