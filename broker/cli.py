"""`laya-pool`: run a pool and operate it.

    laya-pool up --model DIR [--devices cuda:0,cuda:1|cpu] [--workers-per-device N] [--frontend ENDPOINT]
    laya-pool status [--json]              the worker table
    laya-pool drain ID                     stop dispatching to a worker; it finishes its work and leaves
    laya-pool restart-worker ID            drain, restart, rejoin (no request fails meanwhile)
    laya-pool predict --state TEXT --questions JSON
    laya-pool keys --out DIR               CURVE keys (needed to bind a non-loopback address)
    laya-pool broker ...                   a broker alone (workers started elsewhere)

Operator commands talk to the pool through its frontend (`--frontend`, default $LAYA_POOL_FRONTEND or
tcp://127.0.0.1:5555), as wire commands the broker answers.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from protocol import contract
from protocol.contract import WorkerState

DEFAULT_FRONTEND = contract.default_frontend()


def _client(a: argparse.Namespace, **kw: Any):
    """A client for an operator command: with the pool's operator secret when this user has it, and under
    CURVE the operator key pair when the key directory holds one (broker.operator)."""
    from broker.operator import read_secret
    from client.pool import Client
    role = "operator" if a.keys and (Path(a.keys) / "operator.key_secret").is_file() else "client"
    return Client(a.frontend, timeout=a.timeout, keys=a.keys, operator=read_secret(a.frontend), key_role=role, **kw)


def _fail(message: str, code: int = 1) -> int:
    print(f"laya-pool: {message}", file=sys.stderr)
    return code


# ------------------------------------------------------------------------------------------------ commands

def cmd_up(a: argparse.Namespace) -> int:
    from broker.supervisor import Supervisor, SupervisorConfig

    devices = [d.strip() for d in a.devices.split(",") if d.strip()]
    for d in devices:
        if d != "cpu" and not (d.startswith("cuda:") and d[5:].isdigit()) and d != "cuda":
            return _fail(f"--devices: {d!r} is not cpu or cuda:N", 2)
    devices = ["cuda:0" if d == "cuda" else d for d in devices]
    if not Path(a.model).is_dir():
        return _fail(f"--model: {a.model} is not a directory", 2)
    from broker.security import SecurityError, check_endpoints
    try:
        check_endpoints(a.frontend, a.backend or "ipc://", a.keys, a.insecure_backend)
    except SecurityError as e:
        return _fail(str(e), 2)
    if a.http is not None:
        from broker.ops_http import refusal
        if (why := refusal(a.http, a.keys)) is not None:
            return _fail(why, 2)
    from broker.broker import policy_argv
    broker_args = policy_argv(a) + (["--insecure-backend"] if a.insecure_backend else [])
    worker_args: list[str] = ["--warmup-shapes", a.warmup_shapes] if a.warmup_shapes else []
    for name in ("max_tokens", "max_rows", "max_markers", "threads", "max_batch", "compute_timeout"):
        v = getattr(a, name)
        if v is not None:
            worker_args += [f"--{name.replace('_', '-')}", str(v)]
    cfg = SupervisorConfig(model=str(Path(a.model).resolve()), devices=devices, workers_per_device=a.workers_per_device,
                           frontend=a.frontend, backend=a.backend, heartbeat_ms=a.heartbeat_ms, liveness=a.liveness,
                           mode=a.mode, credit=a.credit, keys=a.keys, broker_args=broker_args,
                           worker_args=worker_args, drain_timeout=a.drain_timeout)
    cfg.http = a.http
    return Supervisor(cfg).run()


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def cmd_status(a: argparse.Namespace) -> int:
    from client.pool import PoolError
    try:
        with _client(a, retries=a.retries) as c:
            st = c.status()
    except PoolError as e:
        return _fail(str(e))
    if a.json:
        print(json.dumps(st, indent=2, sort_keys=True))
        return 0
    b = st.get("broker", {})
    print(f"broker pid {b.get('pid')}  frontend {b.get('frontend')}  model {str(b.get('fingerprint'))[:12]}  "
          f"queue {b.get('queue')}/{b.get('queue_size')}  in flight {b.get('inflight')}  "
          f"up {b.get('uptime_s', 0):.0f} s")
    rows = [["ID", "DEVICE", "STATE", "PID", "INFLIGHT", "CREDIT", "DONE", "FAILED", "LOST", "REG", "UP", "SEEN"]]
    for w in st.get("workers", []):
        rows.append([str(w.get("id")), str(w.get("device")), str(w.get("state")), str(w.get("pid")),
                     str(w.get("inflight")), str(w.get("credit")), str(w.get("completed")), str(w.get("failed")),
                     str(w.get("lost")), str(w.get("registrations")), f"{w.get('up_s', 0):.0f}s",
                     f"{w.get('last_seen_ms', 0):.0f}ms"])
    print(_table(rows))
    if len(rows) == 1:
        print("(no workers registered)")
    return 0


def _find(st: dict, wid: str) -> dict | None:
    return next((w for w in st.get("workers", []) if w.get("id") == wid), None)


def cmd_drain(a: argparse.Namespace) -> int:
    from client.pool import PoolError
    try:
        with _client(a) as c:
            r = c.drain(a.id)
            print(f"worker {a.id}: {r.get('state')} ({r.get('inflight')} in flight)")
            if not a.wait:
                return 0
            deadline = time.monotonic() + a.wait_timeout
            while time.monotonic() < deadline:
                w = _find(c.status(), a.id)
                if w is None or w.get("state") not in (WorkerState.DRAINING, WorkerState.READY):
                    print(f"worker {a.id}: {w.get('state') if w else 'gone'}")
                    return 0
                time.sleep(0.2)
            return _fail(f"worker {a.id} still draining after {a.wait_timeout:g} s")
    except PoolError as e:          # RequestFailed is a PoolError
        return _fail(str(e))


def cmd_restart_worker(a: argparse.Namespace) -> int:
    from client.pool import PoolError
    try:
        with _client(a) as c:
            before = _find(c.status(), a.id)
            if before is None:
                return _fail(f"no worker {a.id!r} in this pool")
            r = c.drain(a.id, restart=True)
            print(f"worker {a.id}: {r.get('state')} for a restart ({r.get('inflight')} in flight)")
            if a.no_wait:
                return 0
            deadline = time.monotonic() + a.wait_timeout
            while time.monotonic() < deadline:
                time.sleep(0.2)
                try:
                    w = _find(c.status(), a.id)
                except PoolError:
                    continue
                rejoined = w and w.get("registrations", 0) > before.get("registrations", 0)
                if rejoined and w.get("state") == WorkerState.READY:
                    print(f"worker {a.id}: ready again (pid {w.get('pid')}, was {before.get('pid')})")
                    return 0
            return _fail(f"worker {a.id} did not come back within {a.wait_timeout:g} s")
    except PoolError as e:          # RequestFailed is a PoolError
        return _fail(str(e))


def cmd_predict(a: argparse.Namespace) -> int:
    from client.pool import PoolError
    q = a.questions
    if q.startswith("@"):
        q = Path(q[1:]).read_text(encoding="utf-8")
    try:
        questions = json.loads(q)
    except json.JSONDecodeError as e:
        return _fail(f"--questions: not JSON ({e})", 2)
    if a.state_json is not None:
        try:
            state = json.loads(a.state_json)
        except json.JSONDecodeError as e:
            return _fail(f"--state-json: not JSON ({e})", 2)
    elif a.state is not None:
        state = a.state
    else:
        return _fail("give --state TEXT or --state-json JSON", 2)
    try:
        with _client(a) as c:
            t = time.perf_counter()
            out = c.predict(state, questions, worker=a.worker, mode=a.mode)
            ms = (time.perf_counter() - t) * 1e3
    except (PoolError, ValueError, TypeError) as e:
        return _fail(str(e))
    print(json.dumps(out, indent=2, ensure_ascii=False))
    print(f"({ms:.1f} ms)", file=sys.stderr)
    return 0


def cmd_keys(a: argparse.Namespace) -> int:
    from broker.security import SecurityError, generate
    try:
        keys = generate(a.out, overwrite=a.force)
    except SecurityError as e:
        return _fail(str(e))
    print(f"wrote CURVE keys to {a.out}: server public key {keys['server']}, client public key {keys['client']}")
    print(f"broker:  laya-pool up ... --keys {a.out}   clients / workers: keys={a.out!r}")
    return 0


def cmd_broker(a: argparse.Namespace) -> int:
    from broker.broker import config_from_args, serve
    return serve(config_from_args(a))


# ------------------------------------------------------------------------------------------------ parser

def build_parser() -> argparse.ArgumentParser:
    from broker.broker import add_arguments
    p = argparse.ArgumentParser(prog="laya-pool", description="a multi-process worker pool serving Laya models")
    p.add_argument("--log-level", default=os.environ.get("LAYA_POOL_LOG", "INFO"))
    sub = p.add_subparsers(dest="command", required=True)
    _add_up(sub.add_parser("up", help="run a pool in the foreground until SIGINT/SIGTERM"))
    _add_operator_commands(sub)
    s = sub.add_parser("keys", help="generate CURVE keys")
    s.add_argument("--out", required=True)
    s.add_argument("--force", action="store_true", help="replace existing keys")
    s.set_defaults(fn=cmd_keys)
    s = sub.add_parser("broker", help="run a broker alone")
    add_arguments(s)
    s.set_defaults(fn=cmd_broker)
    return p


def _add_up(up: argparse.ArgumentParser) -> None:
    from broker.broker import add_arguments
    up.add_argument("--model", required=True, help="checkpoint directory")
    up.add_argument("--devices", default="cpu", help="cpu, or cuda:0,cuda:1,...")
    up.add_argument("--workers-per-device", type=int, default=1)
    add_arguments(up, supervised=True)          # the broker's flags, defined once in broker.broker
    # Handed to every worker; None leaves the worker's own default (which depends on its device).
    up.add_argument("--mode", default=None, choices=contract.MODES)
    up.add_argument("--credit", type=int, default=None,
                    help="requests a worker holds at once (default: twice its --max-batch, at least 2)")
    up.add_argument("--max-batch", type=int, default=None,
                    help="queued requests a worker merges into one forward (default: 32 on CUDA, 1 on CPU)")
    up.add_argument("--max-tokens", type=int, default=None)
    up.add_argument("--max-rows", type=int, default=None)
    up.add_argument("--max-markers", type=int, default=None)
    up.add_argument("--threads", type=int, default=None, help="torch threads per worker")
    up.add_argument("--compute-timeout", type=float, default=None,
                    help="seconds a worker's forward may take before its device counts as hung (default 10 on CUDA, "
                         "30 on CPU); the worker leaves, its requests go to other workers, the supervisor restarts it")
    up.add_argument("--warmup-shapes", default=None, help="graph-cached buckets captured before a worker is ready")
    up.add_argument("--drain-timeout", type=float, default=5.0,
                    help="seconds a stopping worker may take to finish its in-flight work before it is killed "
                         "(default 5, so that a stop takes at most 10 s even with a hung device; a longer one lets "
                         "slow requests finish)")
    up.add_argument("--http", default=None, metavar="[HOST:]PORT",
                    help="serve /metrics and /health/{live,ready} here (a bare port: 127.0.0.1; default: off)")
    up.set_defaults(fn=cmd_up)


def _add_operator_commands(sub: Any) -> None:
    def operator(name: str, help: str) -> argparse.ArgumentParser:
        s = sub.add_parser(name, help=help)
        s.add_argument("--frontend", default=DEFAULT_FRONTEND, help="the pool's client endpoint (%(default)s)")
        s.add_argument("--timeout", type=float, default=5.0, help="seconds per attempt")
        s.add_argument("--keys", default=None, help="CURVE key directory")
        return s

    s = operator("status", "the worker table")
    s.add_argument("--json", action="store_true")
    s.add_argument("--retries", type=int, default=1)
    s.set_defaults(fn=cmd_status)

    s = operator("drain", "stop dispatching to a worker; it finishes its work and leaves")
    s.add_argument("id")
    s.add_argument("--wait", action="store_true", help="wait until it has left")
    s.add_argument("--wait-timeout", type=float, default=120.0)
    s.set_defaults(fn=cmd_drain)

    s = operator("restart-worker", "drain a worker, restart it, wait until it rejoins")
    s.add_argument("id")
    s.add_argument("--no-wait", action="store_true")
    s.add_argument("--wait-timeout", type=float, default=180.0)
    s.set_defaults(fn=cmd_restart_worker)

    s = operator("predict", "ask questions about a state; prints the SDK's answer dict as JSON")
    s.add_argument("--state", default=None, help="the state as text")
    s.add_argument("--state-json", default=None, help="the state as JSON (a dict or a conversation list)")
    s.add_argument("--questions", required=True, help="JSON {id: definition}, or @FILE")
    s.add_argument("--worker", default=None)
    s.add_argument("--mode", default=None, choices=contract.MODES)
    s.set_defaults(fn=cmd_predict)


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    logging.basicConfig(level=a.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return a.fn(a)


if __name__ == "__main__":
    sys.exit(main())
