"""Clients of several pools: `Client([ep1, ep2, ...])` and `AsyncClient([...])`.

A decision loop that must outlive a broker host knows several pools (each a broker with its workers, all serving the
same model). Such a client holds one client per pool, each exactly `Client(endpoint)` (its socket, its direct routes,
its retries), and spreads its calls over them:

- a call goes to the pool with the fewest of this client's calls outstanding, ties to the one used least recently
  (the pool's own routing policy, protocol/routing.py, over pools instead of workers);
- when that pool does not answer (unreachable, silent, busy, no worker: a `PoolUnavailable`), the call goes to the
  next pool with what is left of its deadline. Each try gets an equal share of what is left (the last one all of it),
  so a pool that stops answering mid-call still leaves the others time: with the default 10 s and two pools, the
  first try ends at 5 s at the latest, or when its connection has been down `connect_timeout` (3 s);
- a pool that failed a call is tried after the others for HOLD_S, and then only once its connection is up again
  (a pool that is gone is never waited for while another answers);
- a request the pool refused for good (`RequestFailed`: the request is wrong) is not tried elsewhere.

Every error names its pool: `e.pool` is the endpoint, and an error after every pool failed says why each did.
`status()` asks every pool: `{"workers": [rows, each with "pool"], "pools": [{"pool", "broker"} or {"pool",
"error"}]}`. `drain(worker)` goes to the one pool that lists the worker; `reload` to every pool.

Across pools a request is at-least-once (each pool answers a retry of its own from its cache, but not another pool's):
a forward is deterministic, so a request run twice costs time, never a different answer.

One endpoint (a string, or a list of one) is plain `Client(endpoint)`: nothing here is on its path.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from laya_pool.protocol import contract, routing

from .errors import PoolError, PoolUnavailable, RequestFailed
from .pool import Client
from .pool_async import AsyncClient

HOLD_S = 2.0             # a pool that failed a call is tried after the others this long, then once connected again
MIN_TRY_S = 0.05         # less than this left of a call's deadline: no further pool is tried
# The calls spread over the pools (each takes `timeout=`): the SDK's inference API, the card, a ping.
SPREAD = ("forward", "predict", "predict_batch", "predict_long", "decide", "decide_batch", "describe", "card", "ping")


@dataclass
class Member:
    """One pool of a client of several: its endpoint, its client, this client's calls outstanding there."""
    endpoint: str
    client: Any
    inflight: set[int] = field(default_factory=set)     # this client's calls out there (by token)
    credit: int = 1
    last_dispatch: float = 0.0
    failed_at: float | None = None      # when a call last failed over from it; None: it answers

    def healthy(self, now: float) -> bool:
        if self.failed_at is None:
            return True
        if now - self.failed_at < HOLD_S:
            return False
        lock = getattr(self.client, "_lock", None)      # a blocking client reads its connection's events in its calls
        if lock is not None and lock.acquire(blocking=False):
            try:
                self.client._events()
            finally:
                lock.release()
        return self.client._watch.up


class Spread:
    """The choice among the pools and the bookkeeping around it (thread-safe; its only I/O is reading a failed pool's
    connection events, `Member.healthy`)."""

    def __init__(self, members: list[Member]):
        self.members = members
        self.lock = threading.Lock()
        self.tokens = itertools.count()
        self.turn = 0
        self.policy = routing.policy()
        self.failed_over = 0        # tries that failed, each followed by a try of another pool (or the call's error)

    def take(self, tried: list[Member]) -> tuple[Member, int] | None:
        """The pool to try next (the healthy first), and the call's token there; None when every pool was tried."""
        now = time.monotonic()
        with self.lock:
            self.turn += 1
            left = [m for m in self.members if m not in tried]
            m = (self.policy(left, self.turn, lambda m: m.healthy(now)) or self.policy(left, self.turn))
            if m is None:
                return None
            token = next(self.tokens)
            m.inflight.add(token)
            m.last_dispatch = now
            return m, token

    def done(self, m: Member, token: int, failed: bool) -> None:
        with self.lock:
            m.inflight.discard(token)
            if failed:
                m.failed_at = time.monotonic()
                self.failed_over += 1
            elif m.failed_at is not None:
                m.failed_at = None

    def untried(self, tried: list[Member]) -> int:
        return len(self.members) - len(tried)


def share(deadline: float, untried: int) -> float:
    """A try's part of what is left of the call's deadline: an equal share among the pools not tried yet."""
    return max(1e-3, (deadline - time.monotonic()) / max(1, untried))


def named(e: PoolError, endpoint: str) -> PoolError:
    """`e`, saying which pool it came from (`e.pool`; a refusal's message too, which the endpoint does not begin)."""
    if isinstance(e, RequestFailed) and not str(e).startswith(endpoint):
        out = RequestFailed(f"{endpoint}: {e}", field=e.field, row=e.row, worker=e.worker, reason=e.reason)
        out.pool = endpoint
        return out
    e.pool = endpoint
    return e


def all_failed(errors: list[tuple[str, PoolUnavailable]]) -> PoolUnavailable:
    """One error for a call every pool it tried failed: the class they share (else PoolUnavailable), each pool's why."""
    if len(errors) == 1:
        return errors[0][1]
    kinds = {type(e) for _, e in errors}
    cls = kinds.pop() if len(kinds) == 1 else PoolUnavailable
    last = errors[-1][1]
    out = cls(f"no pool answered ({len(errors)} tried): " + "; ".join(str(e) for _, e in errors), last=last.last,
              attempts=sum(e.attempts for _, e in errors), reason=last.reason, retry_after=last.retry_after)
    out.pool = ", ".join(ep for ep, _ in errors)
    return out


def status_of(results: list[tuple[str, Any]]) -> dict[str, Any]:
    """Every pool's status in one: the workers of all (each row with its "pool"), and each pool's broker or error."""
    out: dict[str, Any] = {"workers": [], "pools": []}
    for endpoint, st in results:
        if isinstance(st, BaseException):
            out["pools"].append({"pool": endpoint, "error": str(st), "reason": getattr(st, "reason", None)})
            continue
        out["pools"].append({"pool": endpoint, **{k: v for k, v in st.items() if k != "workers"}})
        out["workers"] += [dict(w, pool=endpoint) for w in st.get("workers", [])]
    errors = [(ep, st) for ep, st in results if isinstance(st, PoolUnavailable)]
    if len(errors) == len(results):
        raise all_failed(errors)
    return out


def holder(st: dict[str, Any], worker: str) -> str:
    """The one pool whose table lists `worker` (for drain)."""
    pools = [w["pool"] for w in st["workers"] if w.get("id") == worker]
    if len(pools) != 1:
        where = "no pool lists it" if not pools else f"{len(pools)} pools list it ({', '.join(pools)})"
        raise RequestFailed(f"worker {worker!r}: {where}; drain it with a client of its pool", field="worker")
    return pools[0]


def _timeout(kwargs: dict[str, Any], default: float) -> float:
    t = kwargs.get("timeout")
    return default if t is None else t


def _endpoints(endpoint: Sequence[str]) -> list[str]:
    eps = [str(e) for e in endpoint]
    if len(set(eps)) != len(eps):
        raise ValueError(f"the same pool twice among {eps}")
    return eps


def _spread_method(name: str, asynchronous: bool) -> Any:
    if asynchronous:
        async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await self._spread(name, args, kwargs)
    else:
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return self._spread(name, args, kwargs)
    method.__name__ = name
    method.__doc__ = f"`{name}` of the pool the call goes to (see laya_pool/client/pools.py)."
    return method


class Pools(Client):
    """A blocking client of several pools (`Client([ep1, ep2, ...])`): the module's docstring says how."""

    def __init__(self, endpoint: Sequence[str], **kwargs: Any):
        self.endpoints = _endpoints(endpoint)
        self.endpoint = ",".join(self.endpoints)
        self.timeout = kwargs.get("timeout", contract.CALL_TIMEOUT_S)
        members = [Member(ep, Client(ep, **kwargs)) for ep in self.endpoints]
        self.spread = Spread(members)

    def _spread(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        deadline = time.monotonic() + _timeout(kwargs, self.timeout)
        tried: list[Member] = []
        errors: list[tuple[str, PoolUnavailable]] = []
        while (chosen := self.spread.take(tried)) is not None:
            m, token = chosen
            failed = True
            try:
                result = getattr(m.client, name)(*args, **dict(kwargs, timeout=share(deadline, self.spread.untried(
                    tried))))
                failed = False
                return result
            except PoolUnavailable as e:
                errors.append((m.endpoint, named(e, m.endpoint)))
                tried.append(m)
                if deadline - time.monotonic() < MIN_TRY_S:
                    break
            except PoolError as e:
                failed = False
                raise named(e, m.endpoint) from None
            finally:
                self.spread.done(m, token, failed)
        raise all_failed(errors)

    def call(self, cmd: Any, build: Any, timeout: float | None = None, retries: int | None = None,
             on_sent: Any = None, started: float | None = None, direct: bool = False) -> Any:
        left = (self.timeout if timeout is None else timeout) - (time.monotonic() - started if started else 0.0)
        return self._spread("call", (cmd, build), {"timeout": left, "retries": retries, "on_sent": on_sent,
                                                   "direct": direct})

    def status(self, *, timeout: float | None = None, retries: int | None = None) -> dict[str, Any]:
        def one(m: Member) -> Any:
            try:
                return m.client.status(timeout=timeout, retries=retries)
            except PoolError as e:
                return named(e, m.endpoint)
        with concurrent.futures.ThreadPoolExecutor(len(self.spread.members)) as ex:
            results = list(ex.map(one, self.spread.members))
        return status_of([(m.endpoint, st) for m, st in zip(self.spread.members, results)])

    def drain(self, worker: str, *, restart: bool = False, timeout: float | None = None) -> dict[str, Any]:
        pool = holder(self.status(timeout=timeout), worker)
        m = next(m for m in self.spread.members if m.endpoint == pool)
        try:
            return m.client.drain(worker, restart=restart, timeout=timeout)
        except PoolError as e:
            raise named(e, m.endpoint) from None

    def reload(self, model: str, fingerprint: str, *, reload_id: str, timeout: float | None = None) -> dict[str, Any]:
        out = {}
        for m in self.spread.members:
            try:
                out[m.endpoint] = m.client.reload(model, fingerprint, reload_id=reload_id, timeout=timeout)
            except PoolError as e:
                out[m.endpoint] = named(e, m.endpoint)
        return {"pools": out}

    def close(self) -> None:
        for m in self.spread.members:
            m.client.close()

    def __del__(self) -> None:
        pass            # each pool's client closes its own sockets


for _name in SPREAD:
    setattr(Pools, _name, _spread_method(_name, asynchronous=False))
Pools.system_one = Pools.predict


class AsyncPools(AsyncClient):
    """An asyncio client of several pools (`AsyncClient([ep1, ep2, ...])`): the module's docstring says how."""

    def __init__(self, endpoint: Sequence[str], **kwargs: Any):
        self.endpoints = _endpoints(endpoint)
        self.endpoint = ",".join(self.endpoints)
        self.timeout = kwargs.get("timeout", contract.CALL_TIMEOUT_S)
        self.spread = Spread([Member(ep, AsyncClient(ep, **kwargs)) for ep in self.endpoints])

    async def _spread(self, name: str, args: tuple, kwargs: dict[str, Any]) -> Any:
        deadline = time.monotonic() + _timeout(kwargs, self.timeout)
        tried: list[Member] = []
        errors: list[tuple[str, PoolUnavailable]] = []
        while (chosen := self.spread.take(tried)) is not None:
            m, token = chosen
            failed = True
            try:
                result = await getattr(m.client, name)(*args, **dict(kwargs, timeout=share(
                    deadline, self.spread.untried(tried))))
                failed = False
                return result
            except PoolUnavailable as e:
                errors.append((m.endpoint, named(e, m.endpoint)))
                tried.append(m)
                if deadline - time.monotonic() < MIN_TRY_S:
                    break
            except PoolError as e:
                failed = False
                raise named(e, m.endpoint) from None
            finally:
                self.spread.done(m, token, failed)
        raise all_failed(errors)

    async def call(self, cmd: Any, build: Any, timeout: float | None = None, retries: int | None = None,
                   on_sent: Any = None, started: float | None = None, direct: bool = False) -> Any:
        left = (self.timeout if timeout is None else timeout) - (time.monotonic() - started if started else 0.0)
        return await self._spread("call", (cmd, build), {"timeout": left, "retries": retries, "on_sent": on_sent,
                                                         "direct": direct})

    async def status(self, *, timeout: float | None = None, retries: int | None = None) -> dict[str, Any]:
        async def one(m: Member) -> Any:
            try:
                return await m.client.status(timeout=timeout, retries=retries)
            except PoolError as e:
                return named(e, m.endpoint)
        results = await asyncio.gather(*(one(m) for m in self.spread.members))
        return status_of([(m.endpoint, st) for m, st in zip(self.spread.members, results)])

    async def drain(self, worker: str, *, restart: bool = False, timeout: float | None = None) -> dict[str, Any]:
        pool = holder(await self.status(timeout=timeout), worker)
        m = next(m for m in self.spread.members if m.endpoint == pool)
        try:
            return await m.client.drain(worker, restart=restart, timeout=timeout)
        except PoolError as e:
            raise named(e, m.endpoint) from None

    def close(self) -> None:
        for m in self.spread.members:
            m.client.close()


for _name in SPREAD:
    setattr(AsyncPools, _name, _spread_method(_name, asynchronous=True))
AsyncPools.system_one = AsyncPools.predict
