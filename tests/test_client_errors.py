"""What a call raises when the pool misbehaves: always a PoolError, never a bare protocol or card error.

A real ROUTER socket in a thread plays the pool and answers each request with what the test scripts.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest
import zmq

from laya_pool.client.errors import BadModelCard, MalformedReply, PoolError, PoolUnavailable, RequestFailed
from laya_pool.client.pool import Client
from laya_pool.client.pool_async import AsyncClient
from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason
from laya_pool.protocol.wire import Cmd


class _FakePool:
    """Answers every message with `answer(message) -> frames` (None: stay silent)."""

    def __init__(self, endpoint: str, answer: Callable[[wire.Message], list | None]):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.bind(endpoint)
        self.answer, self.seen, self.stop = answer, [], threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            identity, *frames = self.sock.recv_multipart()
            msg = wire.decode(frames)
            self.seen.append(msg)
            out = self.answer(msg)
            if out is not None:
                self.sock.send_multipart([identity, *out])

    def __enter__(self) -> _FakePool:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


ROWS = [([5, 6, 7], [1], 0)]


def _rid(msg: wire.Message):
    return msg.header["rid"]


def _ok_with_wrong_counts(msg):
    import numpy as np
    return wire.encode_reply(_rid(msg), np.zeros(5, np.float32), np.zeros((1, 2), np.float32))


CASES = [
    ("garbage frames", lambda m: [b"not", b"laya"], MalformedReply),
    ("an ok reply whose buffers do not match its header",
     lambda m: wire.encode(Cmd.REPLY, {"rid": _rid(m), "status": "ok", "markers": 3, "rows": 1, "n_act": 2},
                           b"\0" * 4, b"\0" * 8), MalformedReply),
    ("an ok reply for another shape than the request", _ok_with_wrong_counts, MalformedReply),
    ("final", lambda m: wire.encode_error(_rid(m), wire.STATUS_FINAL, "no", field="ids", row=0), RequestFailed),
    ("always busy", lambda m: wire.encode_error(_rid(m), wire.STATUS_RETRYABLE, "busy", reason=Reason.BUSY),
     PoolUnavailable),
    ("silence", lambda m: None, PoolUnavailable),
]


@pytest.mark.parametrize("answer,error", [(a, e) for _, a, e in CASES], ids=[c[0] for c in CASES])
def test_forward_raises_pool_errors(tmp_path, answer, error):
    ep = f"ipc://{tmp_path}/pool"
    with _FakePool(ep, answer), Client(ep, timeout=0.3, retries=1, backoff=0.01) as c:
        with pytest.raises(error) as e:
            c.forward(ROWS)
    assert isinstance(e.value, PoolError)


def test_bad_rows_and_a_bad_card_are_pool_errors_too(tmp_path):
    ep = f"ipc://{tmp_path}/pool"
    card = lambda m: wire.encode_body_reply(Cmd.DESCRIBE, _rid(m), {"agent_config": {}})  # noqa: E731
    with _FakePool(ep, card), Client(ep, timeout=0.5, retries=0) as c:
        with pytest.raises(RequestFailed) as e:
            c.forward([([1, 2], [0], "choice")])              # a qtype must be an integer
        assert e.value.field == "rows[0].qtype"
        with pytest.raises(BadModelCard, match="tokenizer_json"):
            c.card()


def test_async_client_has_drain_ping_and_status_retries(tmp_path):
    ep = f"ipc://{tmp_path}/pool"
    calls = {"status": 0}

    def answer(m):
        if m.cmd == Cmd.STATUS:
            calls["status"] += 1
            if calls["status"] == 1:       # the first attempt is answered "busy": status(retries=1) retries it
                return wire.encode_error(_rid(m), wire.STATUS_RETRYABLE, "busy", cmd=Cmd.STATUS, reason=Reason.BUSY)
            return wire.encode_body_reply(Cmd.STATUS, _rid(m), {"workers": []})
        if m.cmd == Cmd.DRAIN:
            return wire.encode_body_reply(Cmd.DRAIN, _rid(m), {"worker": m.header["worker"],
                                                               "restart": m.header["restart"]})
        return wire.encode(Cmd.HEARTBEAT, {"rid": _rid(m), "status": "ok"})

    async def go(c: AsyncClient):
        assert await c.status(retries=1) == {"workers": []}
        assert await c.drain("3", restart=True) == {"worker": "3", "restart": True}
        assert 0 < await c.ping() < 5

    with _FakePool(ep, answer) as pool:
        c = AsyncClient(ep, timeout=1.0, retries=0, backoff=0.01)
        try:
            asyncio.run(go(c))
        finally:
            c.close()
    assert calls["status"] == 2 and [m.cmd for m in pool.seen][-2:] == [Cmd.DRAIN, Cmd.HEARTBEAT]
