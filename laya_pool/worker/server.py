"""The worker process: one device, one model, served to the broker over ZeroMQ.

    python -m laya_pool.worker.server --model DIR --device cpu|cuda:N --backend ENDPOINT --id ID [--mode eager]

Two threads, each with its own DEALER socket to the broker:
- the I/O thread (the main thread, `Worker`) owns the control socket: it registers (READY, which names the data
  socket), sends heartbeats every interval whatever the device is doing, answers DESCRIBE, DRAIN and DISCONNECT,
  watches for a hung device, and hands the data thread any request the broker routed to the control socket;
- the data thread (`worker.compute.Compute` over a `worker.inbox.SocketInbox`) owns the runtime and the data
  socket (identity `<id>@<8 hex digits>/data`): it takes requests from it, runs them and sends the replies on it,
  polling the socket and the launched group's event instead of sleeping while a group computes
  (docs/architecture.md, "The data path").

SIGTERM/SIGINT: stop taking work, finish what was taken, say DISCONNECT, exit 0. A drain does the same
on the broker's request (exit 0, or EXIT_RESTART when the operator asked for a restart). A key or option
problem exits EXIT_CONFIG before the model is loaded, so the supervisor does not reload it in a loop.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq

from laya_pool.protocol import contract, credentials, lane, logs, presence, settings, wire
from laya_pool.protocol.contract import Leave
from laya_pool.protocol.wire import Cmd

from . import placement
from .compute import MERGE_WASTE, Compute, FaultHooks
from .inbox import SocketInbox
from .threadname import name_os_thread

log = logging.getLogger("laya-pool.worker")
_STARTED = time.monotonic()      # start-to-READY is measured from here (interpreter start-up is ~50 ms before it)


POLL_US_CUDA = 2000          # --poll-us's default on CUDA


@dataclass
class WorkerConfig:
    """A worker's command line, typed. None: the default for the device (see `for_device`)."""
    model: str
    backend: str
    id: str
    device: str = "cpu"
    mode: str | None = None                 # default: graph-cached on CUDA, eager on CPU
    heartbeat_ms: int = contract.HEARTBEAT_MS
    liveness: int = contract.LIVENESS
    credit: int | None = None               # default: twice max_batch, at least 2
    compute_timeout: float | None = None    # default: 10 s on CUDA, 30 s on CPU (see `for_device`)
    max_batch: int | None = None            # default: 32 on CUDA (merging is byte-exact there), 1 on CPU
    merge_waste: int = MERGE_WASTE          # padding tokens a merged forward may hold; negative: no bound
    cpus: str | None = None                 # default: the CPUs near the GPU
    threads: int | None = None              # default: one per pinned CPU
    data_cpu: str = "off"                   # the data thread's own CPU: off (the scheduler's choice) or its number
    max_tokens: int | None = None
    max_rows: int | None = None
    max_markers: int | None = None
    max_message_bytes: int = contract.MAX_BACKEND_BYTES
    warmup_shapes: str | None = None
    warmup_merged: str | None = None        # classes whose merged groups are captured (None: see --warmup-merged)
    overlap: str = "on"                     # CUDA: launch the next group while the current one computes
    capture_misses: str = "idle"            # graph-cached: a missed bucket is captured when idle, or "inline"
    gil_switch_ms: float | None = None      # default: Python's own switch interval (5 ms)
    compile_procs: int | None = None        # None: one per spare core, at most 8 (kernels/compile.py procs_for)
    poll_us: int | None = None              # after a reply, the data thread polls this long (default: see --poll-us)
    data_requests: str = "auto"             # requests straight to the data thread: auto = on CUDA (see --data-requests)
    direct: str = "auto"                    # clients send requests here themselves: auto = as data_requests (--direct)
    direct_endpoint: str = "tcp://127.0.0.1:*"   # where the direct socket binds (beyond loopback: with keys only)
    lanes: str = "auto"                     # requests through shared memory too: auto = as direct (--lanes)
    generation: int = 0                     # restart count (set by the supervisor)
    presence_file: str | None = None        # where to say whether the broker has this worker (`laya-pool workers`)
    worker_secret_file: str | None = None   # the broker's worker secret, when not in this user's run directory
    keys: str | None = None
    log_level: str = "INFO"

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> WorkerConfig:
        return cls(**{f.name: getattr(a, f.name) for f in dataclasses.fields(cls)})

    def for_device(self, on_cuda: bool) -> WorkerConfig:
        """The device's defaults filled in."""
        max_batch = self.max_batch if self.max_batch is not None else (32 if on_cuda else 1)
        # A forward that has not finished in this long is a hung device: one group on an H200 takes
        # milliseconds (a first graph capture well under a second); a CPU runs the large model far slower.
        timeout = self.compute_timeout if self.compute_timeout is not None else (10.0 if on_cuda else 30.0)
        data = self.data_requests if self.data_requests != "auto" else ("on" if on_cuda else "off")
        # With keys the direct socket is a CURVE server admitting the keys in `authorized/` (as the broker's
        # frontend does): a worker whose key directory lacks them keeps its clients on the broker.
        direct = self.direct if self.direct != "auto" else (
            "on" if data == "on" and (not self.keys or self.admits_clients()) else "off")
        # A closed-loop caller's next request comes a round trip after its answer: a data thread still polling then
        # answers it ~0.2 ms sooner than one woken from sleep (docs/decisions/0015-poll-windows.md); a CPU
        # worker's forward is too slow for that to matter, and its cores are the tests'.
        poll = self.poll_us if self.poll_us is not None else (POLL_US_CUDA if on_cuda else 0)
        lanes = self.lanes if self.lanes != "auto" else ("on" if direct == "on" and lane.supported() else "off")
        return dataclasses.replace(self, max_batch=max_batch, compute_timeout=timeout, data_requests=data,
                                   direct=direct, poll_us=poll, lanes=lanes,
                                   credit=self.credit if self.credit is not None else max(2, 2 * max_batch),
                                   mode=self.mode or ("graph-cached" if on_cuda else "eager"))

    def admits_clients(self) -> bool:
        return bool(self.keys) and (Path(self.keys) / "authorized").is_dir()

    def usage_problem(self) -> str | None:
        if min(self.credit, self.max_batch, self.heartbeat_ms, self.liveness) < 1:
            return "--credit, --max-batch, --heartbeat-ms and --liveness must be positive"
        if self.data_requests not in ("auto", "on", "off"):
            return f"--data-requests must be auto, on or off (got {self.data_requests!r}); check LAYA_DATA_REQUESTS"
        if self.direct not in ("auto", "on", "off"):
            return f"--direct must be auto, on or off (got {self.direct!r}); check LAYA_DIRECT"
        if self.direct == "on" and self.keys and not self.admits_clients():
            return (f"--direct on with --keys: {self.keys}/authorized is missing (the client keys the direct socket "
                    "admits, as the broker's frontend does; `laya-pool keys` writes it)")
        if self.data_cpu != "off" and not self.data_cpu.isdigit():
            return f"--data-cpu must be off or a CPU number (got {self.data_cpu!r}); check LAYA_DATA_CPU"
        if self.data_cpu != "off" and not self.device.startswith("cuda"):
            # Threads inherit their creator's CPUs: a CPU forward's torch threads would all share the data thread's.
            return "--data-cpu is for CUDA workers (a CPU worker's forward runs torch's threads on the data thread)"
        if self.lanes not in ("auto", "on", "off"):
            return f"--lanes must be auto, on or off (got {self.lanes!r}); check LAYA_LANES"
        if self.lanes == "on" and not lane.supported():
            return "--lanes on: this host has none (they need x86-64 Linux and a writable /dev/shm); --lanes off"
        if not wire.is_loopback(self.direct_endpoint) and not self.keys:
            return (f"--direct-endpoint {self.direct_endpoint!r} is beyond loopback: the direct socket authenticates "
                    "its clients only with CURVE keys (--keys), so without them it binds on loopback or ipc:// only")
        if not (self.direct_endpoint.startswith("tcp://") and self.direct_endpoint.endswith(":*")
                or self.direct_endpoint.startswith("ipc://") and "{id}" in self.direct_endpoint):
            # Every worker of a pool gets the same option: a fixed port would clash, a fixed ipc path be taken over.
            return (f"--direct-endpoint {self.direct_endpoint!r}: each worker binds its own, so a tcp endpoint takes a "
                    "free port (tcp://127.0.0.1:*) and an ipc path names the worker ({id}: ipc:///run/laya/{id}.sock)")
        if not 0 <= self.poll_us <= 10_000_000:
            return f"--poll-us must be in 0..10000000 (got {self.poll_us}); check LAYA_WORKER_POLL_US"
        if self.compile_procs is not None and not 0 <= self.compile_procs <= 64:
            return f"--compile-procs must be in 0..64 (got {self.compile_procs}); check LAYA_COMPILE_PROCS"
        if self.gil_switch_ms is not None and not 0.01 <= self.gil_switch_ms <= 1000:
            return f"--gil-switch-ms must be in 0.01..1000 (got {self.gil_switch_ms}); check LAYA_GIL_SWITCH_MS"
        if self.overlap not in ("on", "off") or self.capture_misses not in ("idle", "inline"):
            # argparse does not check a default taken from the environment against the choices
            return (f"--overlap must be on or off (got {self.overlap!r}) and --capture-misses idle or inline "
                    f"(got {self.capture_misses!r}); check LAYA_OVERLAP / LAYA_CAPTURE_MISSES")
        return None


class Worker:
    """The I/O thread: registration, heartbeats, requests in, replies out, drain and leave."""

    def __init__(self, cfg: WorkerConfig, runtime: Any, device_label: str, faults: FaultHooks = FaultHooks()):
        self.cfg, self.rt, self.device_label = cfg, runtime, device_label
        self.id = cfg.id
        self.hb = cfg.heartbeat_ms / 1000.0
        self.ctx = zmq.Context()
        self.dealer: zmq.Socket | None = None
        self.card_frame = wire.pack(runtime.card())
        self.fingerprint = runtime.fingerprint
        self.stop_requested = False    # set by the signal handler; acted on by the I/O loop
        self.stop_reason: Leave | None = None   # SHUTDOWN | DRAIN | RESTART once draining
        # Written by the data thread only; the I/O thread's own counts are apart (one writer per counter).
        self.counts = {"received": 0, "ok": 0, "request_errors": 0, "internal_errors": 0, "upload_errors": 0,
                       "dropped": 0, "expired": 0, "protocol_errors": 0, "handed_back": 0,
                       "merged_runs": 0, "merged_requests": 0, "set_aside": 0, "bundles": 0, "bundled": 0}
        self.io_counts = {"registrations": 0, "protocol_errors": 0}
        # Each socket its own identity (wire.worker_identity): the broker tells this process's sockets from any other's
        # with its id, and a fresh control socket (after the broker went silent) never meets its predecessor's.
        self.identity = wire.worker_identity(self.id)
        self.data_identity = f"{wire.worker_identity(self.id)}/data"
        self.refused: tuple[str, float] = ("", 0.0)      # the last registration refusal logged, and when
        self.secret_found = False                         # whether the last READY carried a proof
        self.inbox = SocketInbox(self.ctx, cfg.backend, self.data_identity, keys=cfg.keys,
                                 max_message_bytes=cfg.max_message_bytes, poll_us=cfg.poll_us,
                                 heartbeat_ms=cfg.heartbeat_ms,
                                 direct=cfg.direct_endpoint.replace("{id}", cfg.id) if cfg.direct == "on" else None,
                                 lanes=cfg.lanes == "on", direct_max_bytes=wire.request_bytes(
                                     runtime.capacity.max_rows, runtime.capacity.max_tokens,
                                     runtime.capacity.max_markers))
        self.compute = Compute(runtime, self.id, self.fingerprint, cfg.max_batch, self.inbox.send, self.counts,
                               faults, inbox=self.inbox, merge_waste=cfg.merge_waste if cfg.merge_waste >= 0 else None)
        self.compute_thread = threading.Thread(target=self._compute_main, name="compute", daemon=True)
        self.last_sent = self.last_ready = self.broker_expiry = 0.0
        self.hung = False
        self.reconnect_wait = self.hb
        self.presence: str | None = None     # what this worker last told its supervisor (protocol/presence.py)

    def _compute_main(self) -> None:
        name_os_thread("compute")
        if self.cfg.data_cpu.isdigit():
            placement.pin_thread(int(self.cfg.data_cpu))
        try:
            self.inbox.open()       # the data socket is this thread's: created, used and closed here
            self.compute.loop()
        finally:
            self.inbox.close()      # also when the thread dies: an open socket would hang the I/O thread's ctx.term

    # ------------------------------------------------------------------------------------------ sockets

    def _connect(self) -> None:
        if self.dealer is not None:
            self.dealer.close(0)
        s = self.ctx.socket(zmq.DEALER)
        self.identity = wire.worker_identity(self.id)
        s.setsockopt(zmq.IDENTITY, self.identity.encode())
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.MAXMSGSIZE, self.cfg.max_message_bytes)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.cfg.keys:
            wire.configure_curve_client(s, self.cfg.keys, role="worker")
        s.connect(self.cfg.backend)
        self.dealer = s
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)

    def _send(self, frames: list[Any]) -> None:
        try:
            wire.send_frames(self.dealer, frames, copy=False)
            self.last_sent = time.monotonic()
        except zmq.Again:
            log.warning("worker %s: the broker's queue is full; dropped a %s message", self.id,
                        wire.decode(frames).cmd.name)

    def _ready(self) -> None:
        cap = self.rt.capacity
        lim = self.rt.limits
        self.io_counts["registrations"] += 1
        # The proof that the pool started this worker: the worker secret its broker wrote to this user's run
        # directory (or --worker-secret-file), read again at every registration (a restarted broker writes a new one).
        token = credentials.worker_secret(self.cfg.backend, self.cfg.worker_secret_file)
        self.secret_found = token is not None
        proof = {"proof": credentials.proof(token, self.identity.encode())} if token else {}
        self._send(wire.encode(Cmd.READY, {
            "id": self.id, **proof, "data": self.data_identity, "data_requests": self.cfg.data_requests == "on",
            **({"direct": self.inbox.direct_endpoint} if self.inbox.direct_endpoint else {}),
            **({"direct_key": self.inbox.direct_key} if self.inbox.direct_key else {}),
            "device": self.device_label, "fingerprint": self.fingerprint,
            "capacity": {"max_tokens": int(cap.max_tokens), "max_rows": int(cap.max_rows),
                         "max_markers": int(cap.max_markers), "row_markers": int(getattr(cap, "row_markers", 0))},
            "limits": {"vocab_size": int(lim.vocab_size), "max_len": int(lim.max_len)},
            "credit": self.cfg.credit, "pid": os.getpid(), "mode": self.rt.config.mode,
            "generation": self.cfg.generation, "host": socket.gethostname()}))
        self.last_ready = time.monotonic()
        self.broker_expiry = self.last_ready + self.hb * self.cfg.liveness
        self._tell(presence.CONNECTING if self.stop_reason is None else presence.DRAINING)

    def _tell(self, state: str) -> None:
        """Say `state` to the supervisor when it changed (`--presence-file`; a supervisor that cannot read it says
        "starting", so a failed write is not this worker's problem)."""
        if self.cfg.presence_file and state != self.presence:
            self.presence = state
            with contextlib.suppress(OSError):
                presence.write(self.cfg.presence_file, state, os.getpid())

    def _stats(self) -> dict[str, Any]:
        return {**self.counts, "registrations": self.io_counts["registrations"],
                "protocol_errors": self.counts["protocol_errors"] + self.io_counts["protocol_errors"]
                + self.inbox.malformed,
                "outstanding": self.compute.outstanding(), "queued": self.inbox.qsize(),
                "via_control": self.inbox.via_control, "direct": self.inbox.direct_taken,
                "requests_messages": self.inbox.requests_messages,
                "lanes": self.inbox.lanes.taken if self.inbox.lanes is not None else 0,
                "unroutable": self.inbox.unroutable, "answer_seconds": self.compute.answer_seconds.snapshot(),
                "busy_s": round(self.compute.busy_seconds(), 4),
                "runtime": self.compute.runtime_stats}

    # ------------------------------------------------------------------------------------------ the loop

    def run(self) -> int:
        name_os_thread("io")
        self.compute_thread.start()
        self._connect()
        self._ready()
        log.info("worker %s: %s, pid %d, serving %s on %s", self.id, self.device_label, os.getpid(),
                 self.fingerprint[:12], self.cfg.backend)
        while True:
            events = dict(self.poller.poll(max(1, int(self.hb * 1000 / 2))))
            now = time.monotonic()
            if events.get(self.dealer):
                self._read_broker(now)
            code = self._finished()
            if code is not None:
                return code
            if now - self.last_sent >= self.hb:
                self._send(wire.encode(Cmd.HEARTBEAT, {"stats": wire.plain(self._stats())}))
            if now > self.broker_expiry:
                code = self._broker_silent(now)
                if code is not None:
                    return code

    def _read_broker(self, now: float) -> None:
        while True:
            try:
                frames = wire.recv_frames(self.dealer)
            except zmq.Again:
                return
            self.broker_expiry = now + self.hb * self.cfg.liveness
            self.reconnect_wait = self.hb
            self._on_broker(frames, now)

    def _finished(self) -> int | None:
        """The exit code once the worker must leave (fatal, or drained with nothing outstanding)."""
        if self.stop_requested and self.stop_reason is None:
            self._drain(Leave.SHUTDOWN, tell_broker=True)
        if self.compute.fatal is None and not self.compute_thread.is_alive():
            # Heartbeats come from this thread; without this check a dead compute thread would keep
            # the worker looking healthy with its requests never answered.
            self.compute.fatal = "the compute thread died"
        busy = self.compute.busy_since
        if self.compute.fatal is None and busy is not None and time.monotonic() - busy > self.cfg.compute_timeout:
            # The watchdog: heartbeats come from this thread, so only this tells a hung device from a live one.
            # Leaving (DISCONNECT "fatal") makes the broker re-send everything this worker held at once.
            self.hung = True
            self.compute.fatal = (f"the compute thread has been running one group for over "
                                  f"{self.cfg.compute_timeout:g} s (--compute-timeout): the device is hung; "
                                  "leaving for a fresh process")
        if self.compute.fatal is not None:
            log.error("worker %s: fatal: %s", self.id, self.compute.fatal)
            return self._leave(contract.EXIT_FATAL, Leave.FATAL)
        if self.stop_reason is not None and self.compute.outstanding() == 0:
            log.info("worker %s: %s, in-flight work finished; leaving", self.id, self.stop_reason)
            return self._leave(self._drained_code(), self.stop_reason)
        return None

    def _broker_silent(self, now: float) -> int | None:
        """No word from the broker for `liveness` intervals: leave if draining, else reconnect."""
        if self.stop_reason is not None:
            # Draining with no broker to hand replies to: registering again would only invite new work.
            log.warning("worker %s: the broker went silent while %s; leaving", self.id, self.stop_reason)
            return self._leave(self._drained_code(), None)
        # Paranoid Pirate: the broker is gone; a fresh socket and a fresh registration, with backoff.
        log.warning("worker %s: no word from the broker for %.1f s; reconnecting", self.id,
                    self.hb * self.cfg.liveness)
        self.compute.session += 1
        self._connect()
        self._ready()
        self.broker_expiry = now + self.reconnect_wait + self.hb * self.cfg.liveness
        self.reconnect_wait = min(self.reconnect_wait * 2, 16 * self.hb)
        return None

    def _drained_code(self) -> int:
        return contract.EXIT_RESTART if self.stop_reason == Leave.RESTART else contract.EXIT_OK

    def _leave(self, code: int, tell: Leave | None) -> int:
        """Stop the data thread, say why (when there is a broker to tell), flush, and return `code`. The data thread
        says it on its own socket after its last reply (`SocketInbox.close`); this thread says it only when that
        one cannot (hung, or dead)."""
        farewell = None if tell is None else wire.encode(Cmd.DISCONNECT, {"reason": tell})
        self.compute.stopping = True
        alive = self.compute_thread.is_alive() and not self.hung
        if alive:
            self.inbox.farewell = farewell
        elif farewell is not None:
            self._send(farewell)
        self.inbox.put(None)
        self.compute_thread.join(timeout=0.2 if self.hung else 5)   # a hung thread never returns
        if alive and self.compute_thread.is_alive():
            log.error("worker %s: the data thread did not stop; leaving without it", self.id)
            if farewell is not None:
                self._send(farewell)
        self.dealer.close(linger=2000)
        self.inbox.wake_out.close(0)
        if not self.compute_thread.is_alive():
            self.ctx.term()      # returns once the DEALER's queue is flushed (or its linger ran out)
        else:
            time.sleep(0.2)      # ctx.term would wait for the stuck thread's socket: give the DISCONNECT time to go
        return code

    # ------------------------------------------------------------------------------------------ messages

    def _on_broker(self, frames: list[bytes], now: float) -> None:
        try:
            msg = wire.decode(frames)
        except wire.ProtocolError as e:
            self.io_counts["protocol_errors"] += 1
            log.warning("worker %s: malformed message from the broker (%s)", self.id, e)
            return
        if msg.cmd == Cmd.REQUEST:
            self._on_request(msg, now)
        elif msg.cmd == Cmd.HEARTBEAT:
            if self.presence == presence.CONNECTING:
                self._tell(presence.REGISTERED)      # the broker's first heartbeat answers a READY
            drain = msg.header.get("drain")
            if drain in (Leave.DRAIN, Leave.RESTART) and self.stop_reason is None:
                self._drain(Leave(drain))
        elif msg.cmd == Cmd.DRAIN:
            self._drain(Leave.RESTART if msg.header.get("restart") is True else Leave.DRAIN)
        elif msg.cmd == Cmd.DESCRIBE:
            self._send(wire.encode(Cmd.DESCRIBE, {"rid": msg.header.get("rid"), "status": wire.STATUS_OK,
                                                  "fp": self.fingerprint}, self.card_frame))
        elif msg.cmd == Cmd.DISCONNECT:
            self._on_disconnect(msg, now)
        else:
            log.warning("worker %s: unexpected %s from the broker", self.id, msg.cmd.name)

    def _on_disconnect(self, msg: wire.Message, now: float) -> None:
        # The broker does not know us (it restarted, or thought us dead): register again, and drop
        # queued work from the old registration (its clients retry through the new one).
        if self.stop_reason is not None:
            return
        if msg.header.get("reason") == Leave.HUNG:
            # A request outlived the broker's deadline here: a stuck device does not recover in-process,
            # so leave with a fatal code and let the supervisor start a fresh worker.
            self.compute.fatal = "the broker declared this worker hung (a request outlived its deadline)"
            return
        reason = str(msg.header.get("reason"))
        if reason.startswith("registration refused"):
            if reason != self.refused[0] or now - self.refused[1] > 30.0:      # said again every 30 s, not each try
                mine = self.cfg.worker_secret_file or credentials.secret_path(credentials.WORKER, self.cfg.backend)
                log.warning("worker %s: the broker %s; trying again (this worker's secret: %s%s)", self.id, reason,
                            mine, "" if self.secret_found else ", none there")
                self.refused = (reason, now)
            return                       # the next heartbeat is answered "not registered": READY goes then
        if now - self.last_ready < self.hb / 2:
            return
        if now - self.refused[1] > 30.0:     # (while refused, each try would say so)
            log.info("worker %s: broker asked us to re-register (%s)", self.id, reason)
        self.compute.session += 1
        self._ready()
        self.last_ready = now

    def _drain(self, how: Leave, tell_broker: bool = False) -> None:
        if self.stop_reason is None:
            log.info("worker %s: draining (%s), %d in flight", self.id, how, self.compute.outstanding())
            if tell_broker and self.dealer is not None:
                self._send(wire.encode(Cmd.DRAIN, {"reason": how}))   # dispatch nothing more here
        self.stop_reason = how
        self.compute.stopping = True     # the data thread hands back what arrives now (unless addressed here)
        self._tell(presence.DRAINING)

    def _on_request(self, msg: wire.Message, now: float) -> None:
        # Routed to the control socket (the broker does so until it hears the data socket): the data thread takes
        # it as it takes its own, so every request is counted, refused or run in one place.
        self.inbox.put((msg, now))


# ---------------------------------------------------------------------------------------------- setup

def build_parser() -> argparse.ArgumentParser:
    d = WorkerConfig("", "", "")
    p = argparse.ArgumentParser(prog="python -m laya_pool.worker.server", description="a laya-pool worker process",
                                allow_abbrev=False)
    _serving_args(p, d)
    _capacity_args(p, d)
    _timing_args(p)
    _data_path_args(p, d)
    return p


def _serving_args(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """What the worker serves, where, and how much work it takes at once."""
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--device", default=d.device, help="cpu or cuda:N")
    p.add_argument("--backend", required=True, help="the broker's worker endpoint")
    p.add_argument("--id", required=True, help="worker id (unique in the pool)")
    p.add_argument("--mode", default=None, choices=contract.MODES, help="default: graph-cached on CUDA, eager on CPU")
    p.add_argument("--heartbeat-ms", type=int, default=d.heartbeat_ms)
    p.add_argument("--liveness", type=int, default=d.liveness)
    p.add_argument("--credit", type=int, default=None,
                   help="requests the broker may send before a reply (default: twice --max-batch, at least 2)")
    p.add_argument("--compute-timeout", type=float, default=None,
                   help="seconds one forward may take before the device is declared hung and the worker leaves "
                        "(default 10 on CUDA, 30 on CPU)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="queued requests merged into one forward (default: 32 on CUDA, where merging is "
                        "byte-exact; 1 on CPU, where it moves answers in the 6th decimal)")
    p.add_argument("--merge-waste", type=int, default=settings.get("LAYA_MERGE_WASTE"),
                   help="padding tokens a merged forward may hold beyond what its requests pad to alone (every row "
                        "is padded to the group's longest): a request that would take it past waits for the next "
                        "group, first in line. "
                        f"Default {MERGE_WASTE}, about what a forward's fixed cost buys; negative: no bound (every "
                        "request that fits joins); env LAYA_MERGE_WASTE")
    p.add_argument("--cpus", default=None, help="CPU list to pin to (e.g. 0-7); default near the GPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the pinned CPUs)")
    p.add_argument("--data-cpu", default=settings.get("LAYA_DATA_CPU"),
                   help="pin the data thread (it launches every group and answers every request, spinning while "
                        "a group computes) to one CPU, e.g. a core the host keeps for it (isolcpus): off or its "
                        "number; env LAYA_DATA_CPU. Off by default: on hosts whose vCPUs change speed every few "
                        "tens of ms, a CPU quick at start is not quick a minute later "
                        "(docs/decisions/0019-data-thread-pinning-off.md)")


def _capacity_args(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """The largest request, the graphs captured before READY and how groups overlap."""
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-markers", type=int, default=None)
    p.add_argument("--max-message-bytes", type=int, default=d.max_message_bytes)
    p.add_argument("--warmup-shapes", default=None,
                   help="graph-cached: buckets captured before READY, ROWSxLENGTHxMARKERS,... (default: a common set)")
    p.add_argument("--warmup-merged", default=settings.get("LAYA_WARMUP_MERGED"), metavar="RxTxM,...",
                   help="graph-cached: request classes (rows x tokens per row x markers per row of one request, as "
                        "it arrives) whose merged groups of 1..--max-batch are captured before READY too, so a load "
                        "of them normally runs no group eager; '' for none. Default: one question over 48, 64 or "
                        "128 tokens, unless --warmup-shapes is given (then none). The buckets traffic missed most, "
                        "with counts, show in status (stats.runtime.missed_shapes); env LAYA_WARMUP_MERGED (empty: "
                        "the default)")
    # Defaults from the environment too, so a whole pool (`laya-pool up`) can be switched for an A/B measurement.
    p.add_argument("--overlap", default=settings.get("LAYA_OVERLAP"), choices=("on", "off"),
                   help="CUDA: pack and launch the next group while the current one computes (two staging slots); "
                        "off: one group at a time (for measuring; env LAYA_OVERLAP)")
    p.add_argument("--capture-misses", default=settings.get("LAYA_CAPTURE_MISSES"),
                   choices=("idle", "inline"),
                   help="graph-cached: a request whose bucket was not captured runs in a larger captured bucket "
                        "(same answers) or eager, and its bucket is captured when no request waits (idle); inline: "
                        "the request waits for the capture (env LAYA_CAPTURE_MISSES)")


def _timing_args(p: argparse.ArgumentParser) -> None:
    """How the worker's threads share the interpreter, compile and wait."""
    p.add_argument("--gil-switch-ms", type=float, default=settings.get("LAYA_GIL_SWITCH_MS"),
                   help="how long a thread may hold the GIL while another waits (Python's default: 5 ms). The I/O "
                        "thread draining a burst of requests, or the compute thread admitting a group, holds it for "
                        "milliseconds while the other waits (a landed group unanswered, a reply unsent): 0.5 cut "
                        "such a wait from 2.0 to 0.6 ms in a two-thread test, but changed nothing at saturation. For "
                        "measuring; env LAYA_GIL_SWITCH_MS")
    p.add_argument("--compile-procs", type=int, default=settings.get("LAYA_COMPILE_PROCS"),
                   help="CUDA: processes that compile the warm-up's kernels in parallel on a machine whose Triton "
                        "cache lacks them; default one per spare core, at most 8; 0: off (one process compiles them as "
                        "the warm-up runs them, ~20 s more from a cold cache on the H200); env LAYA_COMPILE_PROCS")
    p.add_argument("--poll-us", type=int, default=settings.get("LAYA_WORKER_POLL_US"),
                   help="after each reply the data thread polls its socket this long (microseconds) before it sleeps, "
                        "so the next request of a closed-loop caller finds it awake (it burns its core meanwhile; "
                        "while a group computes it always polls): ~0.2 ms less a request at 1x48, at the price of "
                        f"smaller groups at load. Default {POLL_US_CUDA} on CUDA, 0 on a CPU; env LAYA_WORKER_POLL_US "
                        "(docs/decisions/0015-poll-windows.md)")


def _data_path_args(p: argparse.ArgumentParser, d: WorkerConfig) -> None:
    """Where requests come in (the data thread's socket, the direct socket, lanes), and the rest."""
    p.add_argument("--data-requests", default=settings.get("LAYA_DATA_REQUESTS"),
                   choices=("auto", "on", "off"),
                   help="on: the broker sends requests to the data thread's own socket; off: to the I/O thread, "
                        "which stamps their arrival and hands them over. Replies always leave from the data socket. "
                        "auto (default): on with CUDA, whose data thread is never busy for long; off on a CPU, whose "
                        "forward holds the data thread for seconds, so a request's deadline would count from when it "
                        "is read, not from when it came (env LAYA_DATA_REQUESTS)")
    p.add_argument("--direct", default=settings.get("LAYA_DIRECT"), choices=("auto", "on", "off"),
                   help="on: the data thread also binds a socket (--direct-endpoint) that clients send their requests "
                        "to themselves, skipping the broker (which READY tells them of; the broker stays their "
                        "fallback). With --keys it is a CURVE server with the worker's key pair admitting the keys "
                        "in KEYS/authorized. auto (default): on when requests go to the data thread (--data-requests) "
                        "and, with keys, KEYS/authorized is there; env LAYA_DIRECT")
    p.add_argument("--direct-endpoint", default=settings.get("LAYA_DIRECT_ENDPOINT"),
                   help="where the direct socket binds: tcp with a free port (default tcp://127.0.0.1:*; beyond "
                        "loopback with --keys only, e.g. tcp://10.0.0.5:* for clients on other hosts; a wildcard "
                        "address is announced by this host's name) or ipc://; env LAYA_DIRECT_ENDPOINT")
    p.add_argument("--lanes", default=settings.get("LAYA_LANES"), choices=("auto", "on", "off"),
                   help="on: clients on this host may send their requests through shared memory (protocol/lane.py) "
                        "instead of the direct socket, while the data thread polls. auto (default): on with the "
                        "direct socket on x86-64 Linux; env LAYA_LANES")
    p.add_argument("--generation", type=int, default=d.generation, help="restart count (set by the supervisor)")
    p.add_argument("--presence-file", default=None,
                   help="a file where this worker says whether the broker has it (set by `laya-pool workers`)")
    p.add_argument("--worker-secret-file", default=None,
                   help="a file holding the broker's worker secret, which READY's proof is made from (default: the "
                        "one the broker wrote to this user's run directory; not needed with --keys)")
    p.add_argument("--keys", default=None, help="CURVE key directory (laya-pool keys)")
    p.add_argument("--log-level", default=settings.raw(logs.LEVEL_ENV) or d.log_level)


def _config_problem(cfg: WorkerConfig, parse_shapes: Any, default_warmup: str,
                    default_merged: str) -> tuple[str | None, tuple, tuple]:
    """What is wrong with the keys or the options, found before the model loads: (problem, warm-up shapes, merged
    classes). Without --warmup-shapes or --warmup-merged the runtime also captures what merged groups of common
    requests produce."""
    if cfg.keys:
        try:
            wire.load_curve_keys(cfg.keys, role="worker")
        except (OSError, ValueError) as e:
            return f"cannot use the CURVE keys: {e}", (), ()
    if cfg.mode != "graph-cached":
        return None, (), ()
    try:
        warm = parse_shapes(cfg.warmup_shapes or default_warmup)
    except ValueError as e:
        return f"--warmup-shapes: {e}", (), ()
    merged = cfg.warmup_merged
    if merged is None:
        merged = "" if cfg.warmup_shapes else default_merged     # ('' shapes: not given, as for the shapes above)
    try:
        return None, warm, parse_shapes(merged)
    except ValueError as e:
        return f"--warmup-merged: {e}", (), ()


class _Exit(Exception):
    """Setup cannot go on: leave with `code` (the reason is already logged)."""

    def __init__(self, code: int):
        self.code = code


def _place(cfg: WorkerConfig, torch: Any, torch_device: str) -> list[int] | None:
    """Select the device and pin the CPUs (and torch's threads to them); the CPUs pinned."""
    cpus = placement.parse_cpus(cfg.cpus) if cfg.cpus else None
    if torch_device.startswith("cuda"):
        if not torch.cuda.is_available():
            log.error("device %s requested but CUDA is not available", cfg.device)
            raise _Exit(contract.EXIT_CONFIG)
        torch.cuda.set_device(torch.device(torch_device))
        cpus = cpus or placement.numa_cpus(torch_device)
    pinned = placement.pin(cpus)
    threads = cfg.threads or (len(pinned) if pinned else None)
    if threads:
        torch.set_num_threads(max(1, threads))
    return pinned


def _open_context(torch: Any, torch_device: str) -> threading.Thread | None:
    """Create the CUDA context in a thread while the main thread reads and checks the checkpoint (both wait
    mostly outside the GIL); `_build_runtime` joins it before the weights move to the device."""
    if not torch_device.startswith("cuda"):
        return None
    t = threading.Thread(target=lambda: torch.empty(1, device=torch_device), name="cuda-context", daemon=True)
    t.start()
    return t


def _start_compilers(cfg: WorkerConfig, torch_device: str) -> list | None:
    """The warm-up's compile processes (kernels/compile.py), started before anything else so that their own start runs
    beside this process's imports, checkpoint and weights instead of after them; the warm-up gives them their work or
    lets them go. Opt-in (LAYA_COMPILE_EARLY=1): the children import no torch (`defer_torch`), and early and late
    start then cost the same (READY 14.9 s early against 15.1 late from a cold Triton cache, H100); children that
    imported torch made the worker's own imports and checkpoint as much longer as they made the compile phase shorter
    (docs/decisions/0016-compile-ahead.md)."""
    if not torch_device.startswith("cuda") or not settings.get("LAYA_COMPILE_EARLY"):
        return None
    from laya_pool.kernels.compile import procs_for, spawn
    procs = procs_for(cfg.compile_procs)
    if procs <= 1:
        return None
    try:
        return spawn(procs)
    except OSError as e:          # an optimisation: the warm-up starts its own, or compiles alone
        log.warning("worker %s: could not start the compile processes early: %s", cfg.id, e)
        return None


def _build_runtime(cfg: WorkerConfig, torch_device: str, warm: tuple, merged: tuple, phases: dict[str, float],
                   context: threading.Thread | None = None, compilers: list | None = None) -> tuple[Any, float]:
    """Load the checkpoint, build the runtime and warm it up: (runtime, warm-up ms); `phases` gets ms per step.
    `compilers` (`_start_compilers`) go to the warm-up, which reaps them."""
    from .checkpoint import CheckpointError, load_checkpoint
    from .runtime import Runtime, RuntimeConfig
    from .workspace import Capacity

    log.info("worker %s: loading %s", cfg.id, cfg.model)
    t = time.perf_counter()
    try:
        ck = load_checkpoint(cfg.model)
    except CheckpointError as e:
        log.error("cannot load the checkpoint: %s", e)
        raise _Exit(contract.EXIT_CONFIG) from e
    phases["checkpoint"] = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    if context is not None:
        context.join()         # a context that failed to open fails again, with its error, in Runtime below
    phases["context wait"] = (time.perf_counter() - t) * 1e3
    d = Capacity()
    cap = Capacity(max_tokens=cfg.max_tokens or d.max_tokens, max_rows=cfg.max_rows or d.max_rows,
                   max_markers=cfg.max_markers or d.max_markers, row_markers=d.row_markers)
    try:
        rt = Runtime(ck, device=torch_device, config=RuntimeConfig(
            mode=cfg.mode, capacity=cap, warmup_shapes=warm, warmup_merged=merged, warmup_group=cfg.max_batch,
            capture=cfg.capture_misses, overlap=None if cfg.overlap == "on" else False,
            compile_procs=cfg.compile_procs))
    except ValueError as e:
        log.error("cannot build the runtime: %s", e)
        raise _Exit(contract.EXIT_CONFIG) from e
    except Exception as e:  # noqa: BLE001 - a device that cannot hold the model
        log.exception("cannot build the runtime: %s", e)
        raise _Exit(contract.EXIT_FATAL) from e
    phases["runtime"] = (time.perf_counter() - t) * 1e3
    log.info("worker %s: checkpoint loaded and placed on %s (%.1f s); warming up", cfg.id, torch_device,
             sum(phases.values()) / 1e3)

    def progress(i: int, n: int, what: str) -> None:
        log.info("worker %s: warming %s (%d/%d)", cfg.id, what, i, n)

    t = time.perf_counter()
    try:
        steps = rt.warmup(progress, compilers)
    except Exception as e:  # noqa: BLE001
        log.exception("warm-up failed")
        raise _Exit(contract.EXIT_FATAL) from e
    phases["warm-up"] = (time.perf_counter() - t) * 1e3
    if "compile" in steps:
        log.info("worker %s: kernels compiled ahead in %.1f s: %s", cfg.id, steps["compile ms"] / 1e3, steps["compile"])
    return rt, phases["warm-up"]


def _serve(cfg: WorkerConfig, rt: Any, label: str) -> int:
    # The hooks are read here, once, and handed in: the serving code reads no environment.
    worker = Worker(cfg, rt, label, FaultHooks.from_env())

    def on_signal(signum, _frame):
        worker.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return worker.run()
    except Exception:  # noqa: BLE001 - a dead worker must never look like a clean exit
        log.exception("worker %s: fatal error in the I/O loop", cfg.id)
        return contract.EXIT_FATAL


def main(argv: list[str] | None = None) -> int:
    try:
        parser = build_parser()
    except ValueError as e:       # a flag's default from a variable its declaration refuses (protocol/settings.py)
        print(f"worker: {e}", file=sys.stderr)
        return contract.EXIT_USAGE
    cfg = WorkerConfig.from_args(parser.parse_args(argv))
    logs.setup(f"worker {cfg.id}", cfg.log_level)
    settings.warn_undeclared(log)
    torch_device, label = placement.cuda_local_device(cfg.device)
    cfg = cfg.for_device(torch_device.startswith("cuda"))
    problem = cfg.usage_problem()
    if problem:
        log.error("%s", problem)
        return contract.EXIT_USAGE
    if cfg.gil_switch_ms is not None:
        sys.setswitchinterval(cfg.gil_switch_ms / 1e3)
    early: dict[str, int | None] = {"signal": None}   # a signal before serving: finish starting, then leave

    def early_stop(signum, _frame):
        early["signal"] = signum

    signal.signal(signal.SIGTERM, early_stop)
    signal.signal(signal.SIGINT, early_stop)
    log.info("worker %s: starting on %s (pid %d): importing the runtime", cfg.id, cfg.device, os.getpid())
    compilers = _start_compilers(cfg, torch_device)
    try:
        return _start(cfg, torch_device, label, compilers, early)
    finally:
        if compilers:                 # reaped by the warm-up, unless the start failed before it
            from laya_pool.kernels.compile import release
            release(compilers)


def _start(cfg: WorkerConfig, torch_device: str, label: str, compilers: list | None, early: dict) -> int:
    """main's body from the imports on: import, place, build and warm the runtime, then serve."""
    try:
        import torch

        from .runtime import DEFAULT_MERGED, DEFAULT_WARMUP, parse_shapes
    except Exception as e:  # noqa: BLE001
        log.error("cannot import the runtime: %s", e)
        return contract.EXIT_FATAL
    phases = {"imports": (time.monotonic() - _STARTED) * 1e3}
    problem, warm, merged = _config_problem(cfg, parse_shapes, DEFAULT_WARMUP, DEFAULT_MERGED)
    if problem:
        log.error("%s", problem)
        return contract.EXIT_CONFIG
    try:
        pinned = _place(cfg, torch, torch_device)
        if compilers:
            from laya_pool.kernels.compile import confine, procs_for
            compilers = confine(compilers, pinned, procs_for(cfg.compile_procs))
        rt, warm_ms = _build_runtime(cfg, torch_device, warm, merged, phases, _open_context(torch, torch_device),
                                     compilers)
    except _Exit as e:
        return e.code
    log.info("worker %s: %s (%s), mode %s, forward %s, threads %s, cpus %s, GIL switch %.2f ms, warm-up %.0f ms",
             cfg.id, label, torch_device, cfg.mode, rt.forward_detail, torch.get_num_threads(), pinned,
             sys.getswitchinterval() * 1e3, warm_ms)
    log.info("worker %s: started in %.2f s (%s ms)", cfg.id, time.monotonic() - _STARTED,
             ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
    if early["signal"] is not None:
        return contract.EXIT_OK
    return _serve(cfg, rt, label)


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # do not wait on non-daemon library threads; the exit code is what matters
