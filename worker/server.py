"""The worker process: one device, one model, served to the broker over ZeroMQ.

    python -m worker.server --model DIR --device cpu|cuda:N --backend tcp://127.0.0.1:PORT --id ID [--mode eager]

Two threads:
- the I/O thread (the main thread) owns the DEALER socket to the broker: it registers (READY), sends
  heartbeats every interval whatever the device is doing, decodes requests strictly, answers DESCRIBE,
  DRAIN and DISCONNECT, and forwards finished replies;
- the compute thread owns the runtime: it takes decoded requests from a queue, runs them and hands the
  encoded reply back through an inproc PAIR socket (ZeroMQ sockets are never shared between threads).

A request the runtime refuses (`RequestError`) gets a "final" reply naming field and row and the worker
keeps serving. An unexpected error on a CUDA device is fatal (the context may be poisoned): the request
is handed back as "retryable" (another worker runs it) and the process exits non-zero. SIGTERM/SIGINT:
stop taking work, finish what was taken, say DISCONNECT, exit 0. A drain does the same on the broker's
request (exit 0, or EXIT_RESTART when the operator asked for a restart).
"""
from __future__ import annotations

import argparse
import logging
import os
import queue
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

import zmq

from protocol import contract, wire
from protocol.contract import Leave, Reason
from protocol.wire import Cmd
from worker.batch import Batch, RequestError
from worker.merge import Group

log = logging.getLogger("laya-pool.worker")


@dataclass
class Job:
    session: int
    req: wire.Request
    received: float


class Worker:
    def __init__(self, args: argparse.Namespace, runtime: Any, device_label: str):
        self.args, self.rt, self.device_label = args, runtime, device_label
        self.id = args.id
        self.hb = args.heartbeat_ms / 1000.0
        self.ctx = zmq.Context()
        self.dealer: zmq.Socket | None = None
        self.card_frame = wire.pack(runtime.card())
        self.fingerprint = runtime.fingerprint
        self.jobs: queue.Queue[Job | None] = queue.Queue()
        self.session = 0
        self.outstanding = 0           # requests taken and not yet answered (I/O thread's count)
        self.stop_requested = False           # set by the signal handler; acted on by the I/O loop
        self.stop_reason: str | None = None   # "shutdown" | "drain" | "restart"
        self.fatal: str | None = None
        self.counts = {"received": 0, "ok": 0, "request_errors": 0, "internal_errors": 0, "upload_errors": 0,
                       "dropped": 0, "protocol_errors": 0, "handed_back": 0, "registrations": 0,
                       "merged_runs": 0, "merged_requests": 0}
        self.max_batch = args.max_batch
        # Test hook for a fault no CPU can cause: a device that hangs. LAYA_WORKER_HANG_ROWS=N makes the
        # compute thread block on any request of N rows, while the I/O thread keeps heartbeating.
        self.hang_rows = int(os.environ.get("LAYA_WORKER_HANG_ROWS", "0") or 0)
        # And one that fails inside the run (what a device fault or a runtime bug looks like from here):
        # LAYA_WORKER_FAULT_ROWS=N raises in the run path of any group holding a request of N rows.
        self.fault_rows = int(os.environ.get("LAYA_WORKER_FAULT_ROWS", "0") or 0)
        self.runtime_stats: dict[str, Any] = {}
        self.last_stats = 0.0
        self.pair_io = self.ctx.socket(zmq.PAIR)
        addr = f"inproc://compute-{id(self)}"
        self.pair_io.bind(addr)
        self.pair_compute = self.ctx.socket(zmq.PAIR)
        self.pair_compute.connect(addr)
        self.compute = threading.Thread(target=self._compute_loop, name="compute", daemon=True)

    # ------------------------------------------------------------------------------------------ sockets

    def _connect(self) -> None:
        if self.dealer is not None:
            self.dealer.close(0)
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.IDENTITY, self.id.encode())
        s.setsockopt(zmq.LINGER, 2000)
        s.setsockopt(zmq.MAXMSGSIZE, self.args.max_message_bytes)
        s.setsockopt(zmq.RECONNECT_IVL, 100)
        s.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        if self.args.keys:
            wire.configure_curve_client(s, self.args.keys, role="worker")
        s.connect(self.args.backend)
        self.dealer = s
        self.poller = zmq.Poller()
        self.poller.register(self.dealer, zmq.POLLIN)
        self.poller.register(self.pair_io, zmq.POLLIN)

    def _send(self, frames: list[Any]) -> None:
        try:
            self.dealer.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            self.last_sent = time.monotonic()
        except zmq.Again:
            log.warning("worker %s: the broker's queue is full; dropped a %r message", self.id, bytes(frames[1]))

    def _ready(self) -> None:
        cap = self.rt.capacity
        lim = self.rt.limits
        self.counts["registrations"] += 1
        self._send(wire.encode(Cmd.READY, {
            "id": self.id, "device": self.device_label, "fingerprint": self.fingerprint,
            "capacity": {"max_tokens": int(cap.max_tokens), "max_rows": int(cap.max_rows),
                         "max_markers": int(cap.max_markers), "row_markers": int(getattr(cap, "row_markers", 0))},
            "limits": {"vocab_size": int(lim.vocab_size), "max_len": int(lim.max_len)},
            "credit": self.args.credit, "pid": os.getpid(), "mode": self.rt.config.mode,
            "generation": self.args.generation, "host": socket.gethostname()}))
        self.broker_expiry = time.monotonic() + self.hb * self.args.liveness

    def _stats(self) -> dict[str, Any]:
        return {**self.counts, "outstanding": self.outstanding, "queued": self.jobs.qsize(),
                "runtime": self.runtime_stats}

    # ------------------------------------------------------------------------------------------ I/O thread

    def run(self) -> int:
        self.compute.start()
        self._connect()
        self._ready()
        self.last_sent = time.monotonic()
        reconnect_wait = self.hb
        last_ready = time.monotonic()
        log.info("worker %s: %s, pid %d, serving %s on %s", self.id, self.device_label, os.getpid(),
                 self.fingerprint[:12], self.args.backend)
        while True:
            events = dict(self.poller.poll(max(1, int(self.hb * 1000 / 2))))
            now = time.monotonic()
            if events.get(self.pair_io):
                while True:
                    try:
                        frames = self.pair_io.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.outstanding -= 1
                    self._send(frames)
            if events.get(self.dealer):
                while True:
                    try:
                        frames = self.dealer.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    self.broker_expiry = now + self.hb * self.args.liveness
                    reconnect_wait = self.hb
                    if self._on_broker(frames, now, last_ready):
                        last_ready = now
            if self.stop_requested and self.stop_reason is None:
                self._drain(Leave.SHUTDOWN, tell_broker=True)
            if self.fatal is None and not self.compute.is_alive():
                # Heartbeats come from this thread; without this check a dead compute thread would keep
                # the worker looking healthy with its requests never answered.
                self.fatal = "the compute thread died"
            if self.fatal is not None:
                log.error("worker %s: fatal: %s", self.id, self.fatal)
                self._send(wire.encode(Cmd.DISCONNECT, {"reason": Leave.FATAL}))
                self._close()
                return contract.EXIT_FATAL
            if self.stop_reason is not None and self.outstanding == 0:
                self._send(wire.encode(Cmd.DISCONNECT, {"reason": self.stop_reason}))
                log.info("worker %s: %s, in-flight work finished; leaving", self.id, self.stop_reason)
                self._close()
                return contract.EXIT_RESTART if self.stop_reason == Leave.RESTART else contract.EXIT_OK
            if now - self.last_sent >= self.hb:
                self._send(wire.encode(Cmd.HEARTBEAT, {"stats": wire.plain(self._stats())}))
            if now > self.broker_expiry and self.stop_reason is not None:
                # Draining with no broker to hand replies to: registering again would only invite new work.
                log.warning("worker %s: the broker went silent while %s; leaving", self.id, self.stop_reason)
                self._close()
                return contract.EXIT_RESTART if self.stop_reason == Leave.RESTART else contract.EXIT_OK
            if now > self.broker_expiry:
                # Paranoid Pirate: the broker is gone; a fresh socket and a fresh registration, with backoff.
                log.warning("worker %s: no word from the broker for %.1f s; reconnecting", self.id,
                            self.hb * self.args.liveness)
                self.session += 1
                self._connect()
                self._ready()
                last_ready = now
                self.broker_expiry = now + reconnect_wait + self.hb * self.args.liveness
                reconnect_wait = min(reconnect_wait * 2, 16 * self.hb)

    def _on_broker(self, frames: list[bytes], now: float, last_ready: float) -> bool:
        """Handle one broker message; True when it re-registered."""
        try:
            msg = wire.decode(frames)
        except wire.ProtocolError as e:
            self.counts["protocol_errors"] += 1
            log.warning("worker %s: malformed message from the broker (%s)", self.id, e)
            return False
        if msg.cmd == Cmd.REQUEST:
            self._on_request(msg, now)
        elif msg.cmd == Cmd.HEARTBEAT:
            drain = msg.header.get("drain")
            if drain in ("drain", "restart") and self.stop_reason is None:
                self._drain(drain)
        elif msg.cmd == Cmd.DRAIN:
            self._drain("restart" if msg.header.get("restart") is True else "drain")
        elif msg.cmd == Cmd.DESCRIBE:
            self._send(wire.encode(Cmd.DESCRIBE, {"rid": msg.header.get("rid"), "status": wire.STATUS_OK,
                                                  "fp": self.fingerprint}, self.card_frame))
        elif msg.cmd == Cmd.DISCONNECT:
            # The broker does not know us (it restarted, or thought us dead): register again, and drop
            # queued work from the old session (its clients retry through the new one).
            if self.stop_reason is not None:
                return False
            if msg.header.get("reason") == Leave.HUNG:
                # A request outlived the broker's deadline here: a stuck device does not recover in-process,
                # so leave with a fatal code and let the supervisor start a fresh worker.
                self.fatal = "the broker declared this worker hung (a request outlived its deadline)"
                return False
            if now - last_ready < self.hb / 2:
                return False
            log.info("worker %s: broker asked us to re-register (%s)", self.id, msg.header.get("reason"))
            self.session += 1
            self._ready()
            return True
        else:
            log.warning("worker %s: unexpected %s from the broker", self.id, msg.cmd.name)
        return False

    def _drain(self, how: str, tell_broker: bool = False) -> None:
        if self.stop_reason is None:
            log.info("worker %s: draining (%s), %d in flight", self.id, how, self.outstanding)
            if tell_broker and self.dealer is not None:
                self._send(wire.encode(Cmd.DRAIN, {"reason": how}))   # dispatch nothing more here
        self.stop_reason = how

    def _on_request(self, msg: wire.Message, now: float) -> None:
        rid = msg.header.get("rid")
        if self.stop_reason is not None:
            self.counts["handed_back"] += 1
            self._send(wire.encode_error(rid, wire.STATUS_RETRYABLE, f"worker {self.id} is stopping",
                                         worker=self.id, reason=Reason.STOPPING))
            return
        try:
            req = wire.parse_request(msg)
        except wire.ProtocolError as e:
            self.counts["protocol_errors"] += 1
            self._send(wire.encode_error(rid if isinstance(rid, (int, str)) else None, wire.STATUS_FINAL, str(e),
                                         field=e.field, worker=self.id))
            return
        self.counts["received"] += 1
        self.outstanding += 1
        self.jobs.put(Job(self.session, req, now))

    def _close(self) -> None:
        """Stop the compute thread and flush what is queued for the broker (replies, DISCONNECT)."""
        self.jobs.put(None)
        self.compute.join(timeout=5)
        self.dealer.close(linger=2000)
        self.pair_io.close(0)
        if not self.compute.is_alive():
            self.ctx.term()      # returns once the DEALER's queue is flushed (or its linger ran out)

    # ------------------------------------------------------------------------------------------ compute

    def _compute_loop(self) -> None:
        pair = self.pair_compute
        held: Job | None = None          # taken from the queue, but could not join the last group
        while self.fatal is None:
            if held is not None:
                job, held = held, None
            else:
                try:
                    job = self.jobs.get(timeout=0.5)
                except queue.Empty:
                    self._refresh_stats(force=True)
                    continue
            if job is None:
                break
            jobs, group, held, stop = self._take_group(job)
            if jobs:
                self._run_group(jobs, group)
            self._refresh_stats()
            if stop:
                break
        pair.close(0)

    def _admit(self, job: Job) -> Batch | None:
        """The request's rows if this worker can run them; otherwise answer it here and return None."""
        req = job.req
        if self.hang_rows and len(req.lengths) == self.hang_rows:
            log.warning("worker %s: LAYA_WORKER_HANG_ROWS: hanging on request %r", self.id, req.rid)
            threading.Event().wait()
        if job.session != self.session:
            self.counts["dropped"] += 1
            self._reply(wire.encode_error(req.rid, wire.STATUS_RETRYABLE, "dropped after re-registering",
                                          worker=self.id, reason=Reason.STALE))
            return None
        try:
            batch = Batch(**req.arrays())
            self.rt.check(batch, mode=req.mode, taps=req.taps)
            return batch
        except RequestError as e:
            self.counts["request_errors"] += 1
            self._reply(wire.encode_error(req.rid, wire.STATUS_FINAL, str(e), field=e.field, row=e.row,
                                          worker=self.id))
            return None
        except Exception as e:  # noqa: BLE001 - host-side only (no device work yet): refuse this one request
            self.counts["internal_errors"] += 1
            log.exception("worker %s: could not read request %r", self.id, req.rid)
            self._reply(wire.encode_error(req.rid, wire.STATUS_FINAL, f"internal error: {type(e).__name__}: {e}",
                                          worker=self.id, reason=Reason.INTERNAL))
            return None

    def _take_group(self, first: Job) -> tuple[list[Job], Group, Job | None, bool]:
        """`first` and the queued requests that can share its forward: (their jobs, their rows as a Group in
        the same order, a job held back for the next group, whether the stop sentinel was seen).

        Only requests in the worker's own mode without taps are merged; one that asks for something else
        runs alone. A request that would overflow the workspace waits for the next group."""
        jobs: list[Job] = []
        group = Group()
        job: Job | None = first
        while job is not None:
            special = job.req.taps or job.req.mode not in (None, self.rt.config.mode)
            if jobs and special:
                return jobs, group, job, False
            batch = self._admit(job)
            if batch is not None:
                if jobs and not group.admits(batch, self.rt.capacity):
                    return jobs, group, job, False
                group.add(batch)
                jobs.append(job)
                if special:
                    break
            if len(jobs) >= self.max_batch:
                break
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                break
            if job is None:
                return jobs, group, None, True
        return jobs, group, None, False

    def _run_group(self, jobs: list[Job], group: Group) -> None:
        from worker.upload import UploadError  # imports the CUDA runtime bindings: not before main() has

        if self.fatal is not None:       # an earlier member broke the device: hand the rest to another worker
            for job in jobs:
                self._reply(self._handed_back(job))
            return
        t0 = time.monotonic()
        req0 = jobs[0].req
        try:
            if self.fault_rows and any(b.rows == self.fault_rows for b in group.batches):
                raise RuntimeError(f"LAYA_WORKER_FAULT_ROWS: injected fault on a group with a {self.fault_rows}-row "
                                   "request")
            # Every member passed `check` in _admit and the group fits the workspace: no second validation.
            res = self.rt.run(group.merged(), mode=req0.mode, taps=req0.taps, checked=True)
            done = time.monotonic()
            replies = []
            for job, (logits, act) in zip(jobs, group.split(res.logits, res.act)):
                metrics = dict(res.metrics, batched=len(jobs), queue_ms=(t0 - job.received) * 1e3,
                               worker_ms=(done - job.received) * 1e3)
                replies.append(wire.encode_reply(job.req.rid, logits, act, worker=self.id,
                                                 fingerprint=self.fingerprint, metrics=metrics, taps=res.taps))
        except UploadError as e:
            # The group drained before raising, so the staging is safe to reuse: keep serving, and let
            # the broker run these requests elsewhere.
            self.counts["upload_errors"] += 1
            log.warning("worker %s: %s", self.id, e)
            for job in jobs:
                self._reply(wire.encode_error(job.req.rid, wire.STATUS_RETRYABLE, f"worker {self.id}: {e}",
                                              worker=self.id, reason=Reason.UPLOAD_FAILED))
            return
        except Exception as e:  # noqa: BLE001 - every failure must be answered
            if len(jobs) > 1:
                # Each member passed alone, so run them alone: whatever failed finds its owner, and the
                # others are answered here instead of each losing an attempt with the group.
                for job, batch in zip(jobs, group.batches):
                    self._run_group([job], Group([batch]))
                return
            self._fail(jobs[0], e)
            return
        if len(jobs) > 1:
            self.counts["merged_runs"] += 1
            self.counts["merged_requests"] += len(jobs)
        self.counts["ok"] += len(jobs)
        for frames in replies:
            self._reply(frames)

    def _fail(self, job: Job, e: Exception) -> None:
        """Answer one request whose run raised `e`."""
        req = job.req
        if isinstance(e, RequestError):
            self.counts["request_errors"] += 1
            self._reply(wire.encode_error(req.rid, wire.STATUS_FINAL, str(e), field=e.field, row=e.row,
                                          worker=self.id))
            return
        self.counts["internal_errors"] += 1
        if self.rt.is_cuda:
            log.exception("worker %s: device failure", self.id)
            self._reply(self._handed_back(job, type(e).__name__))
            self.fatal = f"{type(e).__name__}: {e}"     # the context may be poisoned
            return
        log.exception("worker %s: internal error on request %r", self.id, req.rid)
        self._reply(wire.encode_error(req.rid, wire.STATUS_FINAL, f"internal error: {type(e).__name__}: {e}",
                                      worker=self.id, reason=Reason.INTERNAL))

    def _handed_back(self, job: Job, why: str = "an earlier request broke the device") -> list[Any]:
        return wire.encode_error(job.req.rid, wire.STATUS_RETRYABLE, f"worker {self.id} failed ({why}); "
                                 "another worker will run it", worker=self.id, reason=Reason.WORKER_FAULT)

    def _reply(self, frames: list[Any]) -> None:
        self.pair_compute.send_multipart(frames, copy=False)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or now - self.last_stats > 0.25:
            self.last_stats = now
            try:
                self.runtime_stats = wire.plain(self.rt.stats())
            except Exception as e:  # noqa: BLE001 - stats must never stop the worker
                self.runtime_stats = {"error": str(e)}


# ---------------------------------------------------------------------------------------------- setup

def _cuda_local_device(device: str) -> tuple[str, str]:
    """(device for torch, label for the pool). The supervisor sets CUDA_VISIBLE_DEVICES to the one GPU."""
    if not device.startswith("cuda"):
        return device, device
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if visible:
        if str(index) in visible:
            return f"cuda:{visible.index(str(index))}", f"cuda:{index}"
        if len(visible) == 1:
            return "cuda:0", f"cuda:{index}"
    return f"cuda:{index}", f"cuda:{index}"


def _parse_cpus(spec: str) -> list[int]:
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def _numa_cpus(torch_device: str) -> list[int] | None:
    """The CPUs local to the GPU's PCI bus (from sysfs), best effort."""
    try:
        import torch
        props = torch.cuda.get_device_properties(torch.device(torch_device))
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
            return _parse_cpus(f.read().strip())
    except Exception:  # noqa: BLE001 - no sysfs, no props: leave the affinity alone
        return None


def _pin(cpus: list[int] | None) -> list[int] | None:
    if not cpus:
        return None
    try:
        import psutil
        allowed = set(psutil.Process().cpu_affinity())
        cpus = [c for c in cpus if c in allowed] or sorted(allowed)
        psutil.Process().cpu_affinity(cpus)
        return cpus
    except Exception as e:  # noqa: BLE001 - affinity is an optimisation
        log.warning("cannot set CPU affinity %s: %s", cpus, e)
        return None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m worker.server", description="a laya-pool worker process")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N")
    p.add_argument("--backend", required=True, help="the broker's worker endpoint")
    p.add_argument("--id", required=True, help="worker id (unique in the pool)")
    p.add_argument("--mode", default=None, choices=contract.MODES, help="default: graph-cached on CUDA, eager on CPU")
    p.add_argument("--heartbeat-ms", type=int, default=1000)
    p.add_argument("--liveness", type=int, default=3)
    p.add_argument("--credit", type=int, default=None,
                   help="requests the broker may send before a reply (default: twice --max-batch, at least 2)")
    p.add_argument("--max-batch", type=int, default=None,
                   help="queued requests merged into one forward (default: 32 on CUDA, where merging is "
                        "byte-exact; 1 on CPU, where it moves answers in the 6th decimal)")
    p.add_argument("--cpus", default=None, help="CPU list to pin to (e.g. 0-7); default near the GPU")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: the pinned CPUs)")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--max-rows", type=int, default=None)
    p.add_argument("--max-markers", type=int, default=None)
    p.add_argument("--max-message-bytes", type=int, default=1 << 30)
    p.add_argument("--warmup-shapes", default=None,
                   help="graph-cached: buckets captured before READY, ROWSxLENGTHxMARKERS,... (default: a common set)")
    p.add_argument("--generation", type=int, default=0, help="restart count (set by the supervisor)")
    p.add_argument("--keys", default=None, help="CURVE key directory (laya-pool keys)")
    p.add_argument("--log-level", default=os.environ.get("LAYA_POOL_LOG", "INFO"))
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s worker {args.id} %(levelname)s %(message)s")
    torch_device, label = _cuda_local_device(args.device)
    args.max_batch = args.max_batch if args.max_batch is not None else (32 if torch_device.startswith("cuda") else 1)
    args.credit = args.credit if args.credit is not None else max(2, 2 * args.max_batch)
    if args.credit < 1 or args.max_batch < 1 or args.heartbeat_ms < 1 or args.liveness < 1:
        log.error("--credit, --max-batch, --heartbeat-ms and --liveness must be positive")
        return contract.EXIT_USAGE
    stop = {"signal": None}

    def early_stop(signum, _frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, early_stop)
    signal.signal(signal.SIGINT, early_stop)

    cpus = _parse_cpus(args.cpus) if args.cpus else None
    try:
        import torch

        from worker.checkpoint import CheckpointError, load_checkpoint
        from worker.runtime import Runtime, RuntimeConfig, parse_shapes
        from worker.workspace import Capacity
    except Exception as e:  # noqa: BLE001
        log.error("cannot import the runtime: %s", e)
        return contract.EXIT_FATAL
    if torch_device.startswith("cuda"):
        if not torch.cuda.is_available():
            log.error("device %s requested but CUDA is not available", args.device)
            return contract.EXIT_CONFIG
        torch.cuda.set_device(torch.device(torch_device))
        cpus = cpus or _numa_cpus(torch_device)
    pinned = _pin(cpus)
    threads = args.threads or (len(pinned) if pinned else None)
    if threads:
        torch.set_num_threads(max(1, threads))
    try:
        ck = load_checkpoint(args.model)
    except CheckpointError as e:
        log.error("cannot load the checkpoint: %s", e)
        return contract.EXIT_CONFIG
    d = Capacity()
    cap = Capacity(max_tokens=args.max_tokens or d.max_tokens, max_rows=args.max_rows or d.max_rows,
                   max_markers=args.max_markers or d.max_markers, row_markers=d.row_markers)
    mode = args.mode or ("graph-cached" if torch_device.startswith("cuda") else "eager")
    try:
        from worker.runtime import DEFAULT_WARMUP
        warm = parse_shapes(args.warmup_shapes or DEFAULT_WARMUP) if mode == "graph-cached" else ()
        rt = Runtime(ck, device=torch_device, config=RuntimeConfig(mode=mode, capacity=cap, warmup_shapes=warm))
    except ValueError as e:
        log.error("cannot build the runtime: %s", e)
        return contract.EXIT_CONFIG
    except Exception as e:  # noqa: BLE001 - a device that cannot hold the model
        log.exception("cannot build the runtime: %s", e)
        return contract.EXIT_FATAL
    t = time.perf_counter()
    try:
        rt.warmup()
    except Exception:  # noqa: BLE001
        log.exception("warm-up failed")
        return contract.EXIT_FATAL
    log.info("worker %s: %s (%s), mode %s, threads %s, cpus %s, warm-up %.0f ms", args.id, label, torch_device,
             mode, torch.get_num_threads(), pinned, (time.perf_counter() - t) * 1e3)
    if stop["signal"] is not None:
        return contract.EXIT_OK
    worker = Worker(args, rt, label)

    def on_signal(signum, _frame):
        worker.stop_requested = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return worker.run()
    except Exception:  # noqa: BLE001 - a dead worker must never look like a clean exit
        log.exception("worker %s: fatal error in the I/O loop", args.id)
        return contract.EXIT_FATAL


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)   # do not wait on non-daemon library threads; the exit code is what matters
