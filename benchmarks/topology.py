"""What each hop, hand-off and wake-up costs a round trip on this host: the pool's request path from bare parts.

    python -m benchmarks.topology [--samples 2000] [--bytes 400] [--spin-us 0,300] [--think-us 0,1300]
                                  [--awake none,qos,idle] [--out DIR]

What a request path costs in transport and wake-ups alone, so that a path's share of the pool's overhead can be
told from the work at either end: real processes and ZeroMQ sockets over loopback tcp, no model. A client process
sends one message of --bytes and waits for the answer, one at a time, through

- path `broker`: client DEALER -> a forwarding process (ROUTER front and back, one Python loop, as the broker's)
  -> worker DEALER, and back; or `direct`: client DEALER -> worker ROUTER, and back;
- a worker that answers from the thread that received (`inline`, as the data thread does), or (`handoff`) whose I/O
  thread puts the request on a queue, a compute thread takes it and sends the answer back through an inproc PAIR to the
  I/O thread, which sends it);
- every loop blocking in poll (spin 0), or polling without blocking for up to --spin-us after its last message
  before it blocks (a busy-poll window: a core kept awake while traffic is likely);
- the answering thread answering at once, or after --think-us (as a worker waits on its GPU: every other thread
  of the path idle meanwhile, so its core may sink into a deep sleep state that takes long to leave; the answering
  thread itself spins, so the think time is exact and not a sleep's overshoot);
- and all of it again with the cores kept from idling (--awake): `qos` holds /dev/cpu_dma_latency at 0 (Linux PM
  QoS: no deep sleep state; where writable), `idle` runs one spinning process per core at the lowest scheduling
  class (SCHED_IDLE: it runs only when nothing else wants the core, which then never halts; on a VM a halted vCPU is
  the hypervisor's to wake, which PM QoS inside the guest does not reach).

Prints p50 / p95 round trip less the think time (ms) per combination; --out DIR: topology.json.
"""
from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import signal
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import zmq

from benchmarks.common import parser, write


def _wait(poller: zmq.Poller, spin_s: float, timeout_ms: int = 1000) -> dict:
    """poll: without blocking for up to spin_s first (the busy-poll window), then blocking."""
    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            events = poller.poll(0)
            if events:
                return dict(events)
    return dict(poller.poll(timeout_ms))


def _take(q: queue.Queue, spin_s: float) -> Any:
    if spin_s > 0:
        end = time.perf_counter() + spin_s
        while time.perf_counter() < end:
            try:
                return q.get_nowait()
            except queue.Empty:
                pass
    return q.get()


def _think(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def worker(endpoint: str, direct: bool, handoff: bool, spin_s: float, think_s: float = 0.0,
           parent: int | None = None, ready: Any = None) -> None:
    """Answers every message with itself (the envelope kept), after think_s, until it gets b"stop"."""
    if parent is not None:
        _die_with(parent)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER if direct else zmq.DEALER)
    if direct:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
        sock.send(b"ready")
    if ready is not None:
        ready.release()
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    if handoff:
        pair_io, pair_compute = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        pair_io.bind("inproc://answers")
        pair_compute.connect("inproc://answers")
        poller.register(pair_io, zmq.POLLIN)
        todo: queue.Queue = queue.Queue()

        def compute() -> None:
            while True:
                frames = _take(todo, spin_s)
                if frames is None:
                    return
                _think(think_s)
                pair_compute.send_multipart(frames)
        threading.Thread(target=compute, daemon=True).start()
    while True:
        events = _wait(poller, spin_s)
        if handoff and events.get(pair_io):
            sock.send_multipart(pair_io.recv_multipart())
        if events.get(sock):
            frames = sock.recv_multipart()
            if frames[-1] == b"stop":
                if handoff:
                    todo.put(None)
                return
            if handoff:
                todo.put(frames)
            else:
                _think(think_s)
                sock.send_multipart(frames)


def forwarder(front_ep: str, back_ep: str, spin_s: float, parent: int | None = None, ready: Any = None) -> None:
    """The broker's routing reduced to its hops: a request to the one worker, an answer to its client."""
    if parent is not None:
        _die_with(parent)
    ctx = zmq.Context()
    front, back = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
    front.bind(front_ep)
    back.bind(back_ep)
    if ready is not None:
        ready.release()
    who = back.recv_multipart()[0]                    # the worker's "ready"
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back, zmq.POLLIN)
    while True:
        events = _wait(poller, spin_s)
        if events.get(front):
            client, payload = front.recv_multipart()
            back.send_multipart([who, client, payload])
            if payload == b"stop":
                return
        if events.get(back):
            _, client, payload = back.recv_multipart()
            front.send_multipart([client, payload])


def round_trips(endpoint: str, samples: int, warmup: int, size: int, spin_s: float,
                expect: bytes | None = None) -> list[float]:
    """Round trips (ms) of one message at a time; each answer must be `expect` (default: the message sent)."""
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(endpoint)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    # A fresh payload each run: an echo from some other run's process left on the port cannot pass the check.
    payload = os.urandom(size)
    expect = payload if expect is None else expect
    out = []
    try:
        for i in range(warmup + samples):
            t0 = time.perf_counter()
            sock.send(payload)
            if not _wait(poller, spin_s, timeout_ms=5000):
                raise RuntimeError(f"no answer in 5 s at call {i}")
            if sock.recv() != expect:
                raise RuntimeError(f"call {i}: the answer is not the message sent")
            if i >= warmup:
                out.append((time.perf_counter() - t0) * 1e3)
    finally:
        sock.send(b"stop")
        sock.close(1000)
    return out


def measure(path: str, handoff: bool, spin_us: float, ports: tuple[int, int], samples: int, warmup: int,
            size: int, expect: bytes | None = None, think_us: float = 0.0) -> dict[str, float]:
    """p50 / p95 round trip less think_us (ms) through `path` ("broker" or "direct"), the forwarder and worker in
    their own processes on loopback `ports` (front, back)."""
    if samples < 1:
        raise ValueError("samples must be >= 1")
    mpc = mp.get_context("spawn")
    spin_s = spin_us / 1e6
    front = f"tcp://127.0.0.1:{ports[0]}"
    ready, me = mpc.Semaphore(0), os.getpid()
    procs = []
    if path == "direct":
        procs.append(mpc.Process(target=worker, args=(front, True, handoff, spin_s, think_us / 1e6, me, ready),
                                 daemon=True))
    else:
        back = f"tcp://127.0.0.1:{ports[1]}"
        procs.append(mpc.Process(target=forwarder, args=(front, back, spin_s, me, ready), daemon=True))
        procs.append(mpc.Process(target=worker, args=(back, False, handoff, spin_s, think_us / 1e6, me, ready),
                                 daemon=True))
    try:
        for p in procs:
            p.start()
        _started(procs, ready, f"the {path} path's processes")   # a port in use fails here, not in the timing
        xs = sorted(x - think_us / 1e3 for x in round_trips(front, samples, warmup, size, spin_s, expect))
    finally:
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
    return {"p50": round(statistics.median(xs), 4), "p95": round(xs[int(0.95 * (len(xs) - 1))], 4)}


def _started(procs: list, ready: Any, what: str, timeout: float = 30.0) -> None:
    """Wait until every process in `procs` released `ready` once; raise if one exits first or time runs out."""
    deadline, n = time.monotonic() + timeout, 0
    while n < len(procs):
        if ready.acquire(timeout=0.05):
            n += 1
        elif any(p.exitcode is not None for p in procs) or time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not start: exit codes {[p.exitcode for p in procs]}")


@contextlib.contextmanager
def cpu_latency_held() -> Iterator[bool]:
    """Linux PM QoS: while /dev/cpu_dma_latency is held open with 0 written to it, no core enters a sleep state
    slower to leave than 0 us. Yields whether this process could (it needs write access, usually root)."""
    try:
        f = open("/dev/cpu_dma_latency", "wb", buffering=0)
    except OSError:
        yield False
        return
    try:
        try:
            f.write(struct.pack("i", 0))
        except OSError:
            yield False
            return
        yield True
    finally:
        f.close()


def _die_with(parent: int) -> None:
    """Linux: this process dies with its parent, however the parent ends (a child left behind would hold its port,
    or spin, and skew whatever runs next)."""
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)          # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:                              # the parent died before prctl took
        os._exit(1)


def _spin_on(cpu: int, parent: int, ready: Any) -> None:
    _die_with(parent)
    os.sched_setaffinity(0, {cpu})
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    ready.release()
    while True:
        pass


@contextlib.contextmanager
def idle_spinners() -> Iterator[list]:
    """One SCHED_IDLE busy loop per core this process may use, for the block (Linux): yields the spinning
    processes, each at the idle class and spinning by then (none where this is not Linux)."""
    if not hasattr(os, "SCHED_IDLE"):
        yield []
        return
    mpc = mp.get_context("spawn")
    ready, me = mpc.Semaphore(0), os.getpid()
    procs = [mpc.Process(target=_spin_on, args=(cpu, me, ready), daemon=True)
             for cpu in sorted(os.sched_getaffinity(0))]
    try:
        for p in procs:
            p.start()
        _started(procs, ready, "the idle spinners")
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.join(5)


AWAKE = {"none": lambda: contextlib.nullcontext(True), "qos": cpu_latency_held, "idle": idle_spinners}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=2000, help="timed round trips per combination (>= 1)")
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--bytes", type=int, default=400, help="message size (a 1x48 request is ~400 bytes)")
    ap.add_argument("--spin-us", default="0,300", help="busy-poll windows to try, microseconds")
    ap.add_argument("--think-us", default="0", help="the answering thread's busy time to try, microseconds")
    ap.add_argument("--awake", default="none,qos,idle", help=f"ways to keep the cores from idling: {','.join(AWAKE)}")
    ap.add_argument("--port", type=int, default=5720)
    a = ap.parse_args(argv)
    result = {}
    port = a.port
    for awake in a.awake.split(","):
        if awake not in AWAKE:
            ap.error(f"--awake: {awake!r} is not one of {', '.join(AWAKE)}")
    for awake in a.awake.split(","):
        with AWAKE[awake]() as held:
            if not held:
                print(f"{awake}: not available on this host (not writable, or not Linux); skipped", flush=True)
                continue
            for think in (float(t) for t in a.think_us.split(",")):
                for spin in (float(s) for s in a.spin_us.split(",")):
                    for path in ("broker", "direct"):
                        for handoff in (True, False):
                            name = (f"{path:6s} {'handoff' if handoff else 'inline ':7s} spin {spin:g} us, think "
                                    f"{think:g} us{'' if awake == 'none' else ', ' + awake}")
                            result[name] = measure(path, handoff, spin, (port, port + 1), a.samples, a.warmup,
                                                   a.bytes, think_us=think)
                            port += 2
                            print(f"{name:52s} {result[name]['p50']:8.4f} {result[name]['p95']:8.4f}", flush=True)
    write(a.out, "topology", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
