"""client/reader.py: a plain ZeroMQ socket read by a callback on its descriptor, on real inproc sockets."""
import asyncio

import zmq

from laya_pool.client.reader import Reader


def _pair(ctx: zmq.Context, name: str) -> tuple[zmq.Socket, zmq.Socket, bytes]:
    router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
    router.bind(f"inproc://{name}")
    dealer.connect(f"inproc://{name}")
    dealer.send(b"hello")
    ident, _ = router.recv_multipart()
    return router, dealer, ident


async def _until(cond, seconds: float = 2.0) -> None:
    for _ in range(int(seconds / 0.01)):
        if cond():
            return
        await asyncio.sleep(0.01)


def test_every_message_is_handed_on_in_order_and_none_after_close():
    async def main() -> None:
        ctx = zmq.Context()
        router, dealer, ident = _pair(ctx, "order")
        router.send_multipart([ident, b"before"])        # there before the reader
        got: list[list[bytes]] = []
        reader = Reader(dealer, got.append, "test")
        await _until(lambda: len(got) == 1)
        for i in range(50):
            router.send_multipart([ident, b"%d" % i, b"x"])
        await _until(lambda: len(got) == 51)
        assert got == [[b"before"]] + [[b"%d" % i, b"x"] for i in range(50)]
        reader.close()
        router.send_multipart([ident, b"late"])
        await asyncio.sleep(0.1)
        assert len(got) == 51 and dealer.recv_multipart() == [b"late"]
        ctx.destroy(linger=0)
    asyncio.run(main())


def test_a_message_whose_edge_an_operation_took_is_read_after_sent():
    """The hazard `sent()` exists for: a look at the socket (what a send may do) takes the descriptor's edge, and the
    message that came waits for another event; `sent()` finds it."""
    async def main() -> None:
        ctx = zmq.Context()
        router, dealer, ident = _pair(ctx, "edge")
        got: list[list[bytes]] = []
        reader = Reader(dealer, got.append, "test")
        await asyncio.sleep(0.05)
        router.send_multipart([ident, b"reply"])
        assert dealer.EVENTS & zmq.POLLIN            # the look a send takes: the edge is gone
        await asyncio.sleep(0.2)
        assert got == []                              # nothing will wake the reader for it
        reader.sent()
        await _until(lambda: len(got) == 1)
        assert got == [[b"reply"]]
        reader.close()
        ctx.destroy(linger=0)
    asyncio.run(main())


def test_a_fault_in_the_callback_does_not_stop_the_reading(caplog):
    async def main() -> list[bytes]:
        ctx = zmq.Context()
        router, dealer, ident = _pair(ctx, "fault")
        got: list[bytes] = []

        def take(frames: list[bytes]) -> None:
            if frames == [b"bad"]:
                raise ValueError("planted")
            got.append(frames[0])
        reader = Reader(dealer, take, "the test's peer")
        for m in (b"one", b"bad", b"two"):
            router.send_multipart([ident, m])
        await _until(lambda: len(got) == 2)
        reader.close()
        ctx.destroy(linger=0)
        return got
    assert asyncio.run(main()) == [b"one", b"two"]
    assert "a message from the test's peer could not be handed on" in caplog.text


def test_a_reader_is_live_only_on_its_own_running_loop():
    ctx = zmq.Context()
    router, dealer, ident = _pair(ctx, "loops")

    async def make() -> Reader:
        r = Reader(dealer, lambda f: None, "test")
        assert r.live()
        return r
    reader = asyncio.run(make())

    async def later() -> bool:
        return reader.live()
    assert not asyncio.run(later())
    reader.close()                 # its loop is closed: nothing to remove, no error
    ctx.destroy(linger=0)
