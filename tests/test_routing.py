"""protocol/routing.py: the pool's one routing policy, from tables; and the broker and the direct client choosing the
same worker from the same table (a policy planted on one side only is caught)."""
from __future__ import annotations

import random
from dataclasses import dataclass, field

import pytest
import zmq

from laya_pool.broker.broker import Broker, BrokerConfig
from laya_pool.broker.dispatch import Job
from laya_pool.broker.table import WorkerInfo
from laya_pool.client.direct import Route, Routes
from laya_pool.protocol import routing, wire
from laya_pool.protocol.contract import WorkerState


@dataclass
class W:
    id: str
    inflight: set = field(default_factory=set)
    credit: int = 1
    last_dispatch: float = 0.0


def _w(wid: str, inflight: int, credit: int = 1, last: float = 0.0) -> W:
    return W(wid, set(range(inflight)), credit, last)


# (what, workers as (id, in flight, credit, last dispatch), start, usable ids or None, chosen id)
TABLES = [
    ("fewest in flight", [("a", 2, 1, 0), ("b", 1, 1, 0), ("c", 3, 1, 0)], 0, None, "b"),
    ("in flight per credit", [("a", 2, 4, 0), ("b", 1, 1, 0)], 0, None, "a"),
    ("a tie goes to the least recently dispatched", [("a", 1, 2, 5.0), ("b", 2, 4, 3.0), ("c", 1, 2, 4.0)], 0, None,
     "b"),
    ("a full tie to the first in table order", [("a", 0, 1, 0), ("b", 0, 1, 0), ("c", 0, 1, 0)], 0, None, "a"),
    ("... counted from start", [("a", 0, 1, 0), ("b", 0, 1, 0), ("c", 0, 1, 0)], 1, None, "b"),
    ("... start wraps", [("a", 0, 1, 0), ("b", 0, 1, 0), ("c", 0, 1, 0)], 5, None, "c"),
    ("start does not beat the load", [("a", 0, 1, 0), ("b", 1, 1, 0), ("c", 1, 1, 0)], 1, None, "a"),
    ("start does not beat recency", [("a", 0, 1, 1.0), ("b", 0, 1, 2.0), ("c", 0, 1, 3.0)], 2, None, "a"),
    ("only the usable", [("a", 0, 1, 0), ("b", 1, 1, 0), ("c", 2, 1, 0)], 0, {"b", "c"}, "b"),
    ("none usable", [("a", 0, 1, 0)], 0, set(), None),
    ("no workers", [], 0, None, None),
    ("no workers, any start", [], 3, None, None),
]


@pytest.mark.parametrize("table,start,usable,want", [t[1:] for t in TABLES], ids=[t[0] for t in TABLES])
def test_least_loaded(table, start, usable, want):
    workers = [_w(*row) for row in table]
    ok = None if usable is None else (lambda w: w.id in usable)
    got = routing.least_loaded(workers, start, ok)
    assert (got.id if got is not None else None) == want
    assert [(w.id, len(w.inflight)) for w in workers] == [(r[0], r[1]) for r in table], "a policy changes nothing"


def test_the_pools_policy_is_named_in_the_table():
    assert routing.policy() is routing.POLICIES[routing.POLICY] is routing.least_loaded
    with pytest.raises(ValueError, match="'fastest'.*least_loaded"):
        routing.policy("fastest")


# ------------------------------------------------------------------------------------------------ one choice

FP = "f" * 64


@pytest.fixture
def broker(tmp_path):
    b = Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be", fingerprint=FP,
                            operator_secret=False))
    yield b
    b.shutdown()


def _request() -> Job:
    msg = wire.decode(wire.encode_request(1, wire.pack_rows([([1, 2, 3], [0], 0)]), cid="c"))
    return Job(1, "request", ("c", 1), [b"client"], 1, req=wire.parse_request_head(msg, need_cid=True),
               payload=msg.frames)


def _tables(n: int, seed: int = 0) -> list[list[tuple[str, int, int, str, float]]]:
    """Worker tables as (id, in flight, credit, state, last dispatch), small ranges so that ties are common."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        rows = []
        for i in range(rng.randint(1, 5)):
            credit = rng.choice([1, 2, 4])
            rows.append((str(i), rng.randint(0, credit), credit, rng.choice(["ready"] * 4 + ["draining", "dead"]),
                         rng.choice([0.0, 1.0, 2.0])))
        out.append(rows)
    return out


def _broker_choice(b: Broker, rows) -> str | None:
    b.table.workers.clear()
    for wid, inflight, credit, state, last in rows:
        b.table.workers[wid] = WorkerInfo(id=wid, identity=wid.encode(), fingerprint=FP, credit=credit,
                                    state=WorkerState(state), inflight=set(range(inflight)), last_dispatch=last)
    w = b.dispatcher.pick(_request(), b.table.free())
    return None if w is None else w.id


def _client_choice(routes: Routes, rows) -> str | None:
    """The client's table: a route per worker the broker lists as ready (a draining or dead one is down), with the
    requests in flight on it. Its turn starts where the broker's table does."""
    routes.routes.clear()
    for wid, inflight, credit, state, last in rows:
        routes.routes[wid] = Route(wid, f"tcp://127.0.0.1:{5000 + int(wid)}", inflight=dict.fromkeys(range(inflight)),
                                   credit=credit, last_dispatch=last, up=state == "ready", connected=True)
    routes.turn = -1
    r = routes.choose()
    return None if r is None else r.worker


def _disagreements(b: Broker, routes: Routes) -> list:
    """The tables on which the broker, having a free worker, chose another than the client (a client sends its first
    attempt even to a worker at its credit, where the broker would queue it: only the broker's free choices count)."""
    out = []
    for rows in _tables(300):
        mine = _broker_choice(b, rows)
        if mine is not None and mine != _client_choice(routes, rows):
            out.append(rows)
    return out


def test_the_broker_and_the_direct_client_choose_the_same_worker_from_the_same_table(broker):
    ctx = zmq.Context()
    routes = Routes(ctx, None, 1 << 20)
    try:
        chosen = [_broker_choice(broker, rows) for rows in _tables(300)]
        assert len({c for c in chosen if c is not None}) > 1 and None in chosen, "the tables exercise the choice"
        assert _disagreements(broker, routes) == []
        # A policy planted on one side only: the check sees it.
        routes.policy = lambda ws, start=0, usable=None: routing.least_loaded(ws[::-1], start, usable)
        assert _disagreements(broker, routes)
        routes.policy = lambda ws, start=0, usable=None: min(
            (w for w in ws if usable is None or usable(w)), key=lambda w: len(w.inflight), default=None)
        assert _disagreements(broker, routes)
    finally:
        routes.routes.clear()
        ctx.term()
