"""A plain ZeroMQ socket read from an asyncio event loop by a callback on its file descriptor.

`zmq.asyncio` reads through a future a message and a task that awaits it. A callback that receives every message that
is there and hands it on is cheaper: an ipc round trip of 200 bytes to an echo process, 2-vCPU host, took 183-186 us
through `zmq.asyncio` and 122-144 us this way (89-114 us blocking). The asyncio client reads every reply this way
(client/pool_async.py `AsyncClient`, client/direct_async.py).

ZeroMQ's descriptor signals edges, not levels: it turns readable when the socket's state changed, and any operation on
the socket, a send included, may take that edge. So whoever sends on a socket read here calls `sent()` after it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import zmq

log = logging.getLogger("laya-pool.client")


class Reader:
    """Every message on `sock` (a plain socket) handed to `on_frames` from the running event loop, in order."""

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[bytes]], Any], source: str):
        self.loop = asyncio.get_running_loop()
        self.sock, self.on_frames, self.source = sock, on_frames, source
        self.fd = sock.FD
        self.closed = False
        self.loop.add_reader(self.fd, self.drain)
        self.loop.call_soon(self.drain)           # what came before the callback was set

    def drain(self) -> None:
        """Hand on every message there is now (reading EVENTS re-arms the descriptor)."""
        sock = self.sock
        while not self.closed and not sock.closed and sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self.on_frames(frames)
            except Exception:       # noqa: BLE001 - one message's fault must not stop the reading of the rest
                log.exception("a message from %s could not be handed on", self.source)

    def sent(self) -> None:
        """After a send on the socket: a message the send's look at the socket found is read in the next turn."""
        # (getsockopt: 1.8 us where the EVENTS attribute takes 2.8)
        if not self.closed and not self.sock.closed and self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            self.loop.call_soon(self.drain)

    def live(self) -> bool:
        """Open, and on the running loop (a client used by a later `asyncio.run` sets up a new reader)."""
        return not self.closed and not self.loop.is_closed() and self.loop is asyncio.get_running_loop()

    def close(self) -> None:
        """Stop reading (before the socket closes: the descriptor may be reused)."""
        if not self.closed:
            self.closed = True
            if not self.loop.is_closed():
                self.loop.remove_reader(self.fd)
