import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]


def _cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available()
    except Exception:
        return False


# Without CUDA, Triton kernels can still run in Triton's CPU interpreter (tests/test_fast.py). Triton reads
# this when a kernel is defined, so it is set here, before any test module imports kernels/.
if not _cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# Operator secrets (broker.operator) of the pools tests start go to a private directory, not the user's.
os.environ.setdefault("LAYA_POOL_RUNTIME_DIR", tempfile.mkdtemp(prefix="laya-pool-test-run-"))


def _installed() -> bool:
    from importlib import metadata
    try:
        metadata.distribution("laya-pool")
        return True
    except metadata.PackageNotFoundError:
        return False


# For the broker and worker processes tests start: this checkout where laya_pool is not installed (the device),
# then whatever PYTHONPATH held (on the device, that is where pyzmq and laya are carried).
_CHECKOUT = None if _installed() else str(ROOT)
SUBPROCESS_ENV = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [_CHECKOUT, os.environ.get("PYTHONPATH")])))


def stop_all(procs: list) -> None:
    """SIGTERM the processes a test started, newest first, and reap them (SIGKILL after 20 s)."""
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


def free_port() -> int:
    """A loopback TCP port nobody listens on right now and not handed out before in this process (the OS may give
    the same free port to two calls in a row, and a test binding both then fails)."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


_GIVEN_PORTS: set[int] = set()


class LoadThreads:
    """A test load's client threads: started when its `with` block opens; `stop` set and each joined (JOIN_S at most)
    when it ends. A subclass builds `threads` and `stop`."""

    JOIN_S = 60.0
    threads: list[threading.Thread]
    stop: threading.Event

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.JOIN_S)


def wait_until(predicate: Callable[[], Any], timeout: float, message: str | Callable[[], str],
               interval: float = 0.05, ignore: tuple[type[BaseException], ...] = ()) -> Any:
    """Poll `predicate` until it returns something truthy (returned), failing with `message` after `timeout`
    seconds. Exceptions of the `ignore` types count as "not yet" (a pool that is still starting); any other
    exception, an assertion inside the predicate included, fails at once."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = predicate()
            if value:
                return value
        except ignore:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout:g} s: {message() if callable(message) else message}")
        time.sleep(interval)


def assert_answers_close(want: Any, have: Any, path: str = "") -> None:
    """`have` is `want` (an SDK answer dict, or anything built of dicts, lists and scalars): the same keys in the
    same order, the same types, equal values, floats within 2e-4 (answers are rounded to 4 decimals)."""
    if isinstance(want, dict):
        assert isinstance(have, dict) and list(want) == list(have), f"{path}: keys {list(want)} != {list(have)}"
        for k in want:
            assert_answers_close(want[k], have[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert isinstance(have, (list, tuple)) and len(want) == len(have), f"{path}: {want!r} != {have!r}"
        for i, (x, y) in enumerate(zip(want, have)):
            assert_answers_close(x, y, f"{path}[{i}]")
    elif isinstance(want, float) and isinstance(have, float):
        assert abs(want - have) <= 2e-4 or (want != want and have != have), f"{path}: {want} != {have}"
    else:
        # type first: False == 0 and 1.0 == 1, but a caller who reads the dict can tell them apart
        assert type(want) is type(have) and want == have, f"{path}: {want!r} != {have!r}"


def make_rows(seed: int, n: int = 3, length: int | tuple[int, int] = 40, markers: int | tuple[int, int] = (1, 4),
              vocab: int = 1000) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """`n` request rows `(ids int32, markers int32, qtype)`, the same for the same arguments.

    `length` and `markers` (per row) are a number or a [low, high) range to draw from; markers are distinct
    sorted positions after [CLS]; question types cycle 0, 1, 2, so three rows cover every type."""
    rng = np.random.default_rng(seed)

    def draw(v: int | tuple[int, int]) -> int:
        return v if isinstance(v, int) else int(rng.integers(*v))

    rows = []
    for i in range(n):
        size = draw(length)
        k = min(draw(markers), size - 1)
        where = np.sort(rng.choice(np.arange(1, size), size=k, replace=False)).astype(np.int32)
        rows.append((rng.integers(5, vocab, size).astype(np.int32), where, i % 3))
    return rows


def make_ckpt(out: Path, preset: str = "tiny", seed: int = 0) -> Path:
    subprocess.run([sys.executable, "-m", "laya_pool", "make-checkpoint", "--out", str(out),
                    "--preset", preset, "--seed", str(seed)], check=True, capture_output=True, env=SUBPROCESS_ENV)
    return out


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_ckpt(tmp_path_factory.mktemp("ckpt") / "tiny")


@pytest.fixture(scope="session")
def sdk_agent(tiny_ckpt):
    laya = pytest.importorskip("laya")
    with warnings.catch_warnings():
        # The generator ships temperatures the SDK clamps (on purpose); its warning is expected.
        warnings.simplefilter("ignore")
        return laya.load(str(tiny_ckpt), device="cpu")


def pytest_collection_modifyitems(config, items):
    if _cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA (run on the device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def tiny_runtime(tiny_ckpt):
    """The tiny checkpoint's runtime on the CPU, in this process: what a pool's answers are checked against."""
    import torch

    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime
    torch.set_num_threads(1)
    return Runtime(load_checkpoint(tiny_ckpt), device="cpu")


def reference_logits(runtime, rows):
    """`rows` run in-process by `runtime` (`tiny_runtime`): the logits a pool must answer."""
    from laya_pool.worker.batch import Batch
    return runtime.run(Batch.from_rows(rows)).logits
