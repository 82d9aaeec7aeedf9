"""The steps of a plan: each API call (`forward`, `predict`, `describe`, ...) is written once, as a generator that
yields the pool calls and other work it needs and gets their answers back (client/base.py `_Base`); `Client` runs a
plan with blocking calls, `AsyncClient` with awaited ones."""
from __future__ import annotations

import concurrent.futures
from collections.abc import Callable, Generator
from dataclasses import dataclass
from typing import Any, TypeVar

from laya_pool.protocol import wire
from laya_pool.protocol.wire import Cmd

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    """A plan's step: one pool call (sent and retried by the driver); its answer is (message, attempts)."""
    cmd: Cmd
    build: Callable[[int, str], list[Any]]     # (request id, client id) -> frames
    timeout: float | None = None
    retries: int | None = None
    on_sent: Callable[[], None] | None = None  # work that overlaps the wait (after the first send)
    direct: bool = False                       # the first attempt may go to a worker directly (client/direct.py)


@dataclass(frozen=True)
class NeedCard:
    """A plan's step: the model card (the driver fetches it once, under its own lock where it has one)."""
    timeout: float | None
    refresh: bool = False


@dataclass(frozen=True)
class Await:
    """A plan's step: wait for work running in a thread (the whole state's tokens); its answer is its result.
    The asyncio driver awaits it, so the event loop never blocks on it."""
    future: concurrent.futures.Future
    timeout: float | None = None               # the call's timeout: the wait ends with the call's deadline


@dataclass(frozen=True)
class Many:
    """A plan's step: several requests (each a plan of its own); its answer is their results, in order.
    Both drivers keep up to `BATCH_IN_FLIGHT` of their calls on the wire together (the pool merges them)."""
    plans: list[Generator[Any, Any, Any]]


Plan = Generator["Call | NeedCard | Await | Many", Any, T]


def header_only(cmd: Cmd, **fields: Any) -> Callable[[int, str], list[Any]]:
    return lambda rid, cid: wire.encode(cmd, {"rid": rid, **fields})


def starter(encoded: list[Any]) -> Callable[[], None]:
    """What a request does once sent: start tokenizing its states whole in the background (their usage counts)."""
    def start() -> None:
        for e in encoded:
            e.state.start()
    return start
