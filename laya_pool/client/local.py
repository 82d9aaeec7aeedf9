"""`local_pool`: a pool (`laya-pool up` as a subprocess) for the life of a `with` block, and its `LocalPool` handle.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from laya_pool.protocol.contract import WorkerState

from .errors import (
    PoolError,
    PoolUnavailable,
)
from .pool import Client

__all__ = ["LocalPool", "local_pool"]


@dataclass
class LocalPool:
    endpoint: str
    process: subprocess.Popen
    log_path: Path | None
    keys: str | None = None

    def client(self, **kwargs: Any) -> Client:
        return Client(self.endpoint, keys=self.keys, **kwargs)

    def status(self) -> dict[str, Any]:
        with self.client(timeout=5.0, retries=1) as c:
            return c.status()

    def log(self) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM the supervisor (it drains and stops everything); SIGKILL if it does not exit in time."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
        return self.process.returncode


@contextlib.contextmanager
def local_pool(model_dir: str | os.PathLike, devices: str = "cpu", *, workers_per_device: int = 1,
               frontend: str | None = None, heartbeat_ms: int | None = None, liveness: int | None = None,
               startup_timeout: float = 180.0, log: str | os.PathLike | None = None, keys: str | None = None,
               extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[LocalPool]:
    """Start a pool (`laya-pool up` as a subprocess) for the life of a `with` block.

    Returns once every worker has registered. The endpoints default to ipc sockets in a private
    temporary directory. `log` is a file for the pool's output (default: a file in that directory,
    read with `pool.log()`). With `keys` (a `laya-pool keys` directory) everything speaks CURVE."""
    tmp = Path(tempfile.mkdtemp(prefix="laya-pool-"))
    os.chmod(tmp, 0o700)
    frontend = frontend or f"ipc://{tmp}/frontend"
    cmd = [sys.executable, "-m", "laya_pool", "up", "--model", str(model_dir), "--devices", devices,
           "--workers-per-device", str(workers_per_device), "--frontend", frontend, "--backend", f"ipc://{tmp}/backend"]
    for flag, value in (("--heartbeat-ms", heartbeat_ms), ("--liveness", liveness), ("--keys", keys)):
        if value is not None:
            cmd += [flag, str(value)]
    log_path = Path(log) if log is not None else tmp / "pool.log"
    pool = LocalPool(frontend, _spawn([*cmd, *extra_args], log_path, env), log_path,
                     keys=None if keys is None else str(keys))
    failed = True
    try:
        n_workers = len([d for d in devices.split(",") if d.strip()]) * workers_per_device
        _wait_for_workers(pool, n_workers, startup_timeout)
        yield pool
        failed = False
    finally:
        pool.stop()
        # The private directory goes away with the pool; its log stays when something went wrong.
        for p in tmp.iterdir():
            if p != log_path or not failed:
                with contextlib.suppress(OSError):
                    p.unlink()
        with contextlib.suppress(OSError):
            tmp.rmdir()


def _spawn(cmd: list[str], log_path: Path, env: dict[str, str] | None) -> subprocess.Popen:
    """`cmd` in its own session, a checkout first on PYTHONPATH, its output appended to `log_path`."""
    full_env = dict(os.environ)
    # Where this package lies (a checkout's root, or site-packages, where the child finds it by itself).
    home = Path(sys.modules[__name__.split(".")[0]].__file__).resolve().parents[1]
    if home.name not in ("site-packages", "dist-packages"):
        full_env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(home), full_env.get("PYTHONPATH")]))
    full_env.update(env or {})
    with open(log_path, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=full_env, start_new_session=True)


def _wait_for_workers(pool: LocalPool, n_workers: int, timeout: float) -> None:
    """Until `n_workers` are ready; PoolError (with the log's tail) if the pool exits or time runs out."""
    deadline = time.monotonic() + timeout
    with pool.client(timeout=2.0, retries=0) as c:
        while True:
            if pool.process.poll() is not None:
                raise PoolError(f"the pool exited with code {pool.process.returncode} while starting "
                                f"(log: {pool.log_path}):\n{pool.log()[-4000:]}")
            try:
                if sum(1 for w in c.status()["workers"] if w["state"] == WorkerState.READY) >= n_workers:
                    return
            except PoolUnavailable:
                pass
            if time.monotonic() > deadline:
                raise PoolError(f"the pool did not get {n_workers} workers ready within {timeout:g} s "
                                f"(log: {pool.log_path}):\n{pool.log()[-4000:]}")
            time.sleep(0.2)
