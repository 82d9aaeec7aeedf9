"""What the benchmarks share: their command line, the statistics they print, the pool they measure, their results.

Every benchmark is run from the checkout's root as `python -m benchmarks.NAME ...` after the README's install, and
writes its results as JSON under `--out DIR` (NAME.json, with the GPU, the versions and the date) besides printing
them. One that needs a pool starts its own (`laya-pool up` on `--devices`, a tcp frontend on loopback) unless
`--frontend` names a running one.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any


def parser(doc: str | None) -> argparse.ArgumentParser:
    """A benchmark's parser: its docstring as the help, whole flags only, `--out DIR` for the results."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                 allow_abbrev=False)
    ap.add_argument("--out", help="directory for the results (NAME.json); printed only when absent")
    return ap


def add_pool(ap: argparse.ArgumentParser, model: bool = True) -> None:
    """--model (a checkpoint: `laya-pool make-checkpoint --out /tmp/large --preset large --seed 0`), --frontend,
    --devices."""
    if model:
        ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--frontend", help="measure the pool running there instead of starting one")
    ap.add_argument("--devices", default="cuda:0", help="the devices of the pool this starts")


def free_endpoint() -> str:
    """A tcp endpoint on loopback with a port nothing holds now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


@contextlib.contextmanager
def pool(model: str, frontend: str | None, devices: str = "cuda:0", extra_args: list[str] | tuple[str, ...] = (),
         env: dict[str, str] | None = None) -> Iterator[str]:
    """The frontend to measure: `frontend` as given, or a pool started for the block (`laya-pool up`, ready)."""
    if frontend:
        yield frontend
        return
    from laya_pool import local_pool
    with local_pool(model, devices, frontend=free_endpoint(), extra_args=list(extra_args), env=env) as p:
        yield p.endpoint


@contextlib.contextmanager
def stub_pool(broker_args: tuple[str, ...] | list[str] = (), stub_args: tuple[str, ...] | list[str] = ()
              ) -> Iterator[str]:
    """A broker (`python -m laya_pool.broker.broker`) and one stub worker (laya_pool/tools/stub_worker.py, with
    `stub_args`) on private ipc sockets; the frontend."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="laya-stub-") as d:
        fe, be = f"ipc://{d}/fe", f"ipc://{d}/be"
        procs = [subprocess.Popen([sys.executable, "-m", "laya_pool.broker.broker", "--frontend", fe, "--backend", be,
                                   "--log-level", "WARNING", *broker_args])]
        try:
            time.sleep(1.0)                 # bound before the worker connects: its READY is not lost
            procs.append(subprocess.Popen([sys.executable, "-m", "laya_pool.tools.stub_worker", "--backend", be,
                                           *stub_args]))
            time.sleep(1.0)
            yield fe
        finally:
            for p in procs:
                p.terminate()
            for p in procs:
                p.wait(10)


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds process `pid` (on this host) has used so far, its threads included (from /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def percentiles(ms: list[float]) -> dict[str, float]:
    """p50, p95 and min of samples in ms (the benchmarks' figures are medians with their p95)."""
    s = sorted(ms)
    return {"p50": round(statistics.median(s), 4), "p95": round(s[int(0.95 * (len(s) - 1))], 4),
            "min": round(s[0], 4), "n": len(s)}


def machine() -> dict[str, Any]:
    """The GPU (when torch sees one), the versions and the date a result comes with."""
    out: dict[str, Any] = {"date": time.strftime("%Y-%m-%d %H:%M"), "python": platform.python_version(),
                           "cpu": platform.processor() or platform.machine()}
    with contextlib.suppress(ImportError):
        import torch
        out["torch"] = torch.__version__
        if torch.cuda.is_available():
            out["gpu"] = torch.cuda.get_device_name()
    return out


def write(out: str | None, name: str, result: Any) -> Path | None:
    """`result` as DIR/NAME.json with `machine()`; nothing without --out."""
    if not out:
        return None
    path = Path(out) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"machine": machine(), "result": result}, indent=1) + "\n")
    print(f"results: {path}")
    return path
