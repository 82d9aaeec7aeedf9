"""An event loop that polls without sleeping for a while after each event (`laya-pool api --spin-us`).

A gateway request wakes the gateway's event loop twice: when the HTTP request arrives and when the pool's answer
does. A loop asleep in epoll takes each wake-up from the kernel's scheduler, tens to hundreds of microseconds on a
virtual machine's vCPUs; the pool's own processes avoid it the same way (the worker polls 2 ms after a reply,
docs/decisions/0015-poll-windows.md). Here the loop keeps asking epoll with a zero timeout for `spin_s` after the
last event it saw before it sleeps, so a request in a steady stream finds it awake. The price is the gateway's core
while requests come; with no traffic for `spin_s` it sleeps as any loop does. Measured with `benchmarks.http --stub`
(docs/decisions/0024-gateway-event-loop-polls.md): at one client 2 ms of polling took the gateway's p50 from 1.31-1.46
to 1.07-1.12 ms; at 8 and 32 clients it changed nothing beyond the runs' spread. Off by default: while the pool
computes, the loop polls on a core that CPU workers on the same host would want (`up --api` turns it on for CUDA).

Pure standard library: `SpinSelector` is a `selectors` selector; `loop_factory` makes the loop gateway/server.py runs.
"""
from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable
from typing import Any


class SpinSelector(selectors.DefaultSelector):  # type: ignore[misc,valid-type]
    """The platform's selector, polling (timeout 0) until `spin_s` after the last event before it blocks."""

    def __init__(self, spin_s: float):
        super().__init__()
        self.spin_s = spin_s
        self.last_event = float("-inf")

    def select(self, timeout: float | None = None) -> list[Any]:
        start = now = time.monotonic()
        end = self.last_event + self.spin_s
        if timeout is not None:
            end = min(end, start + timeout)
        while now < end:
            events = self._wait(0)
            if events:
                self.last_event = time.monotonic()
                return events
            now = time.monotonic()
        events = self._wait(None if timeout is None else max(0.0, timeout - (now - start)))
        if events:
            self.last_event = time.monotonic()
        return events

    def _wait(self, timeout: float | None) -> list[Any]:
        """The platform selector's own select."""
        return super().select(timeout)


def loop_factory(spin_s: float) -> Callable[[], asyncio.AbstractEventLoop]:
    """A factory of event loops that spin `spin_s` after each event (asyncio's own loop when 0)."""
    if spin_s <= 0:
        return asyncio.SelectorEventLoop
    return lambda: asyncio.SelectorEventLoop(SpinSelector(spin_s))
