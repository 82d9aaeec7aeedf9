"""HTTP decisions: the gateway (`laya-pool api` before a pool) against `laya serve` on the same checkpoint and card.

    python -m benchmarks.http --model /tmp/large [--devices cuda:0] [--clients 1,8,64] [--seconds 10]
        [--gateway-processes N] [--gateway-args "FLAGS"] [--stub] [--out DIR]

N concurrent HTTP clients (--clients, each a kept-alive connection in a closed loop, spread over --procs processes)
send one-question 1x48 requests (`laya_pool.tools.bench.make_request`) to `POST /v1/systemone` for --seconds, all
starting together once every connection has warmed up (--warmup requests each): first to the gateway (a pool started
here on --devices unless --frontend names one), then to `laya serve` (`python -m laya.serve`, the SDK's server, this
checkpoint as its `english`, on the first of --devices), alternating which goes first from one N to the next. Prints
decisions per second (answers 200 a second), the p50 / p95 of every request, the p50 of the server's own inference
time (`inside`: its X-Inference-Time-Ms, the pool call in the gateway, the forward in laya serve), the server's CPU
per request (its processes', children included), the gateway's throughput over laya serve's, and at 1 client the
gateway's p50 less the pooled `Client.predict` p50 measured in the same run.

`--stub`: the gateway alone, before a broker and a stub worker that answers at once with the checkpoint's card and
zeros (laya_pool/tools/stub_worker.py): what one gateway process can answer, on any machine.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from queue import Empty
from typing import Any

from benchmarks.common import add_pool, cpu_seconds, parser, pool, stub_pool, write

ROOT = Path(__file__).resolve().parents[1]
SERVERS = ("gateway", "laya-serve")


def request_bytes(model: str) -> bytes:
    """One kept-alive `POST /v1/systemone` of a one-question request whose row is (at most) 48 tokens."""
    from laya_pool.client.card import ModelCard
    from laya_pool.tools.bench import make_request
    state, questions = make_request(ModelCard.from_dir(model), 1, 48)
    body = json.dumps({"state": state, "questions": questions}).encode()
    return (b"POST /v1/systemone HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body)) + body


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    request: bytes) -> tuple[int, float | None, bytes]:
    """Send `request`, read its answer whole; the status code, the answer's X-Inference-Time-Ms (the server's own
    time for the inference: the pool call in the gateway, the forward in laya serve) if it has one, and the body of an
    answer other than 200 (empty for a 200)."""
    writer.write(request)
    head = await reader.readuntil(b"\r\n\r\n")
    fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
    body = await reader.readexactly(int(fields.get(b"content-length", 0)))
    inside = fields.get(b"x-inference-time-ms")
    code = int(head.split(b" ", 2)[1])
    return code, None if inside is None else float(inside), b"" if code == 200 else body


STALE = (asyncio.IncompleteReadError, ConnectionError)    # a kept-alive connection the server closed
REFUSALS_KEPT = 3            # answers other than 200 kept (status and body) a row, to say why


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


async def _connections(port: int, request: bytes, n: int, seconds: float, warmup: int, ready: Any,
                       start: Any) -> tuple[list[float], list[float], Counter, list[str]]:
    """`n` connections, warmed up together, then each in a closed loop for `seconds`. A server closes a kept-alive
    connection left idle past its keep-alive timeout (uvicorn's 5 s, in both servers), as it may while the other
    processes warm up: such a connection is reopened and the request sent again, as HTTP clients do, the reopening
    inside the request's time and counted as `reopened`. The first REFUSALS_KEPT answers other than 200 are kept
    (status and body), to say why."""
    conns = [list(await _open(port)) for _ in range(n)]
    codes: Counter = Counter()
    refusals: list[str] = []

    async def send(c: list) -> tuple[int, float | None, bytes]:
        try:
            return await _exchange(c[0], c[1], request)
        except STALE:
            c[1].close()
            c[:] = await _open(port)
            codes["reopened"] += 1
            return await _exchange(c[0], c[1], request)

    async def warm(c: list) -> None:
        for _ in range(warmup):
            await send(c)
    await asyncio.gather(*(warm(c) for c in conns))
    ready.put(1)
    await asyncio.get_running_loop().run_in_executor(None, start.wait)
    codes.clear()
    end, lat, inside = time.perf_counter() + seconds, [], []

    async def closed_loop(c: list) -> None:
        while time.perf_counter() < end:
            t = time.perf_counter()
            code, ms, body = await send(c)
            lat.append((time.perf_counter() - t) * 1e3)
            codes[code] += 1
            if code != 200 and len(refusals) < REFUSALS_KEPT:
                refusals.append(f"{code} {body[:200].decode(errors='replace')}")
            if ms is not None:
                inside.append(ms)
    await asyncio.gather(*(closed_loop(c) for c in conns))
    for c in conns:
        c[1].close()
    return lat, inside, codes, refusals


def clients(port: int, request: bytes, n: int, seconds: float, warmup: int, ready: Any, start: Any,
            results: Any) -> None:
    """A process of `n` HTTP clients; its latencies (ms), the servers' inference times (ms), its status counts and its
    first answers other than 200."""
    lat, inside, codes, refusals = asyncio.run(_connections(port, request, n, seconds, warmup, ready, start))
    results.put((lat, inside, dict(codes), refusals))


def measure(port: int, request: bytes, n: int, seconds: float, warmup: int, procs: int) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ready, results, start = ctx.Queue(), ctx.Queue(), ctx.Event()
    shares = [n // procs + (i < n % procs) for i in range(min(n, procs))]
    ps = [ctx.Process(target=clients, args=(port, request, k, seconds, warmup, ready, start, results))
          for k in shares]
    for p in ps:
        p.start()
    try:
        _gather(ready, ps, 600)
        start.set()
        out = _gather(results, ps, seconds + 300)
    finally:
        for p in ps:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    lat = sorted(x for part, _, _, _ in out for x in part)
    inside = [x for _, part, _, _ in out for x in part]
    codes = sum((Counter(c) for _, _, c, _ in out), Counter())
    ok, reopened = codes.get(200, 0), codes.pop("reopened", 0)
    return {"clients": n, "decisions_per_s": round(ok / seconds, 1), "p50_ms": round(statistics.median(lat), 3),
            "p95_ms": round(lat[int(0.95 * (len(lat) - 1))], 3),
            "inference_p50_ms": round(statistics.median(inside), 3) if inside else None,
            "requests": sum(codes.values()),
            "not_200": {str(k): v for k, v in codes.items() if k != 200}, "reopened": reopened,
            "refusals": [r for _, _, _, part in out for r in part][:REFUSALS_KEPT]}


def _gather(queue: Any, procs: list, timeout: float) -> list:
    """One item from `queue` per process of `procs`; raises as soon as one of them died without putting it."""
    got, deadline = [], time.monotonic() + timeout
    while len(got) < len(procs):
        try:
            got.append(queue.get(timeout=0.5))
        except Empty:
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            if dead or time.monotonic() > deadline:
                raise SystemExit(f"a client process failed (exit codes {dead})" if dead else
                                 f"the client processes did not answer within {timeout:g} s") from None
    return got


def client_p50(frontend: str, model: str, seconds: float, warmup: int) -> float:
    """The pooled `Client.predict` p50 (ms) of the same request, one caller in a closed loop."""
    from laya_pool import Client
    from laya_pool.client.card import ModelCard
    from laya_pool.tools.bench import make_request
    state, questions = make_request(ModelCard.from_dir(model), 1, 48)
    with Client(frontend, timeout=30) as c:
        for _ in range(warmup):
            c.predict(state, questions)
        lat, end = [], time.perf_counter() + seconds
        while time.perf_counter() < end:
            t = time.perf_counter()
            c.predict(state, questions)
            lat.append((time.perf_counter() - t) * 1e3)
    return round(statistics.median(lat), 3)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server(kind: str, model: str, frontend: str, device: str, most: int, processes: int = 1,
           gateway_args: tuple[str, ...] = ()) -> Iterator[tuple[int, subprocess.Popen]]:
    """The gateway or laya serve on a free loopback port, up and answering /health, for the block: (port, process)."""
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    if kind == "gateway":
        argv = [sys.executable, "-m", "laya_pool", "api", "--frontend", frontend, "--listen", str(port),
                "--max-concurrent", str(most + 16), "--processes", str(processes), "--log-level", "warning",
                *gateway_args]
    else:
        argv = [sys.executable, "-m", "laya.serve"]
        env.update(LAYA_HOST="127.0.0.1", LAYA_PORT=str(port), LAYA_EXTRA_MODELS=json.dumps({"english": model}),
                   LAYA_MODELS="english", LAYA_DEFAULT_MODEL="english", LAYA_DEVICE=device,
                   LAYA_MAX_CONCURRENT=str(most + 16), LAYA_LOG_LEVEL="warning")
        if device == "cpu":
            env["LAYA_THREADS"] = "1"           # as the CPU pool's one worker thread
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_up(proc, port, kind)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def tree_cpu(pid: int) -> float:
    """CPU seconds process `pid` and its children (the gateway's --processes) have used so far."""
    import psutil
    pids = [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    total = 0.0
    for p in pids:
        with contextlib.suppress(OSError):
            total += cpu_seconds(p)
    return total


def _wait_up(proc: subprocess.Popen, port: int, kind: str, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"{kind} exited with code {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
            if s.recv(64).startswith(b"HTTP/1.1 200"):
                return
        time.sleep(0.5)
    raise SystemExit(f"{kind} did not answer /health within {timeout:g} s")


def run(args: Any, frontend: str) -> dict[str, Any]:
    counts = [int(x) for x in args.clients.split(",")]
    servers = [s for s in SERVERS if s in args.servers.split(",")]
    device = args.devices.split(",")[0]
    request = request_bytes(args.model)
    rows: dict[int, dict[str, Any]] = {n: {} for n in counts}
    for i, n in enumerate(counts):
        for kind in (servers if i % 2 == 0 else servers[::-1]):
            with server(kind, args.model, frontend, device, max(counts), args.gateway_processes,
                        tuple(args.gateway_args.split())) as (port, proc):
                cpu0 = tree_cpu(proc.pid)
                rows[n][kind] = row = measure(port, request, n, args.seconds, args.warmup, args.procs)
                row["server_cpu_ms_per_request"] = round((tree_cpu(proc.pid) - cpu0) * 1e3 / max(1, row["requests"]),
                                                         3)
    out: dict[str, Any] = {"request": "1x48, one question", "seconds": args.seconds,
                           "gateway_processes": args.gateway_processes, "rows": rows}
    for row in rows.values():
        if all(s in row and row[s]["decisions_per_s"] for s in SERVERS):
            row["gateway_over_laya_serve"] = round(row["gateway"]["decisions_per_s"] / row["laya-serve"]
                                                   ["decisions_per_s"], 2)
    if 1 in rows and "gateway" in rows[1]:
        out["client_predict_p50_ms"] = client_p50(frontend, args.model, args.seconds, args.warmup)
        out["gateway_minus_client_p50_ms"] = round(rows[1]["gateway"]["p50_ms"] - out["client_predict_p50_ms"], 3)
    return out


def report(out: dict[str, Any]) -> None:
    print(f"{'clients':>7}  {'server':<10} {'decisions/s':>11} {'p50 ms':>8} {'p95 ms':>8} {'inside':>7}  "
          f"{'cpu ms/r':>9}  not 200")
    for n, row in out["rows"].items():
        for kind in SERVERS:
            if kind in row:
                r = row[kind]
                inside = "-" if r.get("inference_p50_ms") is None else f"{r['inference_p50_ms']:.3f}"
                print(f"{n:>7}  {kind:<10} {r['decisions_per_s']:>11.1f} {r['p50_ms']:>8.3f} {r['p95_ms']:>8.3f} "
                      f"{inside:>7}  "
                      f"{r['server_cpu_ms_per_request']:>9.3f}  {r['not_200'] or '-'}"
                      + (f"  ({r['reopened']} reopened)" if r.get("reopened") else ""))
                for refusal in r.get("refusals") or ():
                    print(f"{'':>7}  {kind:<10} answered {refusal}")
        if "gateway_over_laya_serve" in row:
            print(f"{n:>7}  gateway / laya serve: {row['gateway_over_laya_serve']}x decisions/s")
    if "gateway_minus_client_p50_ms" in out:
        print(f"at 1 client: gateway p50 - Client.predict p50 = {out['gateway_minus_client_p50_ms']:.3f} ms "
              f"(Client.predict p50 {out['client_predict_p50_ms']:.3f} ms)")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    add_pool(ap)
    ap.add_argument("--clients", default="1,8,64", help="concurrent HTTP clients, a run each")
    ap.add_argument("--seconds", type=float, default=10.0, help="how long every run sends")
    ap.add_argument("--warmup", type=int, default=20, help="requests each connection sends before the run")
    ap.add_argument("--procs", type=int, default=4, help="client processes the connections are spread over")
    ap.add_argument("--servers", default=",".join(SERVERS), help="which of gateway,laya-serve to measure")
    ap.add_argument("--gateway-processes", type=int, default=1, help="the gateway's --processes")
    ap.add_argument("--gateway-args", default="", help="more of the gateway's flags, e.g. '--spin-us 2000'")
    ap.add_argument("--stub", action="store_true",
                    help="the gateway alone before a stub worker that answers at once with the checkpoint's card "
                         "(laya_pool/tools/stub_worker.py): the gateway's own ceiling, on any machine")
    args = ap.parse_args(argv)
    warnings.simplefilter("ignore")
    if args.stub:
        args.servers = "gateway"
        ctx = stub_pool(stub_args=["--model", args.model, "--direct-endpoint", "tcp://127.0.0.1:*"])
    else:
        extra = ["--threads", "1"] if args.devices == "cpu" else []
        ctx = pool(args.model, args.frontend, args.devices, extra_args=extra)
    with ctx as frontend:
        out = run(args, frontend)
    report(out)
    write(args.out, "http", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
