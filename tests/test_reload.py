"""`laya-pool reload --model DIR` on a real pool (two CPU workers, two tiny checkpoints of different seeds)
under continuous client load: no request fails, answers before come from the old model and after from the
new one (checked against the laya SDK on each checkpoint), and the clients moved to the new model card by
its fingerprint. A checkpoint the workers cannot load is rolled back and reported (exit 1)."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, LoadThreads, make_ckpt, wait_until

from laya_pool.client.errors import PoolUnavailable
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol import contract

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(300)

CASES = [
    ("the printer on floor 3 is broken and nobody can print the quarterly report",
     {"team": {"type": "choice", "instructions": "Which team handles this ticket?",
               "criteria": {"it": "hardware and software problems", "hr": "people matters", "sales": "deals"}},
      "urgent": {"type": "noul", "instructions": "Is this urgent?"}}),
    ({"ticket": 4411, "text": "please refund order 99, it arrived broken", "customer": "vip"},
     {"severity": {"type": "score", "instructions": "How severe is it?", "criteria": ["minor", "major", "critical"]}}),
]


def _close(a, b) -> bool:
    """Equal structure; numbers within 2e-4 (answers are rounded to 4 decimals)."""
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_close(x, y) for x, y in zip(a, b))
    if isinstance(a, float) and not isinstance(b, bool):
        return abs(a - b) <= 2e-4
    return a == b


def _sdk_answers(ckpt: Path) -> list[dict]:
    laya = pytest.importorskip("laya")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        agent = laya.load(str(ckpt), device="cpu")
        return [agent.predict(state, qs) for state, qs in CASES]


def _cli(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laya_pool", *args], capture_output=True, text=True,
                          timeout=timeout, env=SUBPROCESS_ENV, cwd=str(ROOT))


class _Load(LoadThreads):
    """Clients asking the CASES in a loop, each on its own thread; every answer kept with its time."""

    def __init__(self, endpoint: str, n: int):
        self.endpoint, self.stop = endpoint, threading.Event()
        self.answers: list[tuple[float, int, dict]] = []
        self.errors: list[str] = []
        self.cards: list[str] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(n)]

    def _run(self) -> None:
        with Client(self.endpoint, timeout=20, retries=3) as c:
            i = 0
            while not self.stop.is_set():
                state, qs = CASES[i % len(CASES)]
                try:
                    out = c.predict(state, qs)
                except Exception as e:  # noqa: BLE001 - any failure is what this test counts
                    with self.lock:
                        self.errors.append(f"{type(e).__name__}: {e}")
                else:
                    with self.lock:
                        self.answers.append((time.monotonic(), i % len(CASES), out))
                i += 1
            with self.lock:
                self.cards.append(c.card().fingerprint)

    def count(self) -> int:
        with self.lock:
            return len(self.answers)


def test_rolling_reload_under_load_fails_nothing(tiny_ckpt, tmp_path):
    new = make_ckpt(tmp_path / "new", seed=7)
    broken = make_ckpt(tmp_path / "broken", seed=8)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    old_fp, new_fp = contract.fingerprint(tiny_ckpt), contract.fingerprint(new)
    want_old, want_new = _sdk_answers(tiny_ckpt), _sdk_answers(new)
    assert old_fp != new_fp
    assert not any(_close(a, b) for a, b in zip(want_old, want_new)), "the two checkpoints answer alike"

    with local_pool(tiny_ckpt, "cpu", workers_per_device=2, heartbeat_ms=250,
                    extra_args=["--threads", "1"]) as pool:
        def workers() -> dict:
            return {w["id"]: w for w in pool.status()["workers"]}
        wait_until(lambda: all(w["state"] == "ready" for w in workers().values()), 120, pool.log,
                   ignore=(PoolUnavailable,))

        # A checkpoint the workers cannot load: worker 0 goes back to the old model, the CLI says so.
        r = _cli("reload", "--model", str(broken), "--frontend", pool.endpoint, "--wait-timeout", "120")
        assert r.returncode == 1 and "could not start it on the new checkpoint" in r.stderr, r.stdout + r.stderr
        assert "Traceback" not in r.stderr
        wait_until(lambda: all(w["state"] == "ready" and w["fingerprint"] == old_fp for w in workers().values()),
                   120, pool.log, ignore=(PoolUnavailable,))
        assert "reload to" in pool.log() and "failed" in pool.log()
        assert "worker 0: loading" in pool.log() and "importing the runtime" in pool.log()   # progress lines

        with _Load(pool.endpoint, 3) as load:
            wait_until(lambda: load.count() >= 6, 60, "the load never got going")
            started = time.monotonic()
            r = _cli("reload", "--model", str(new), "--frontend", pool.endpoint, "--wait-timeout", "200")
            finished = time.monotonic()
            assert r.returncode == 0, r.stdout + r.stderr + pool.log()[-4000:]
            n = load.count()
            wait_until(lambda: load.count() >= n + 9 and load.answers[-1][0] > finished + 1.5, 60,
                       "the pool stopped answering after the reload")
        t = time.perf_counter()

    assert not load.errors, load.errors[:5]
    assert "reload done" in r.stdout and r.stdout.count("on the new model") == 2, r.stdout
    before = [(i, a) for when, i, a in load.answers if when < started]
    after = [(i, a) for when, i, a in load.answers if when > finished + 0.5]
    assert before and len(after) >= 6
    assert all(_close(a, want_old[i]) for i, a in before), "an answer before the reload is not the old model's"
    assert all(_close(a, want_new[i]) for i, a in after), "an answer after the reload is not the new model's"
    assert all(_close(a, want_old[i]) or _close(a, want_new[i]) for _, i, a in load.answers)
    assert load.cards == [new_fp] * 3, "a client kept the old model card"
    print(f"reload under load: {len(load.answers)} answers, 0 failed, reload took {finished - started:.1f} s, "
          f"stop {time.perf_counter() - t:.1f} s")


# ------------------------------------------------------------------------------------------------ status reading

def _st(fp: str, *workers: tuple[str, str, str, int, int], reload_id: str | None = None) -> dict:
    return {"broker": {"fingerprint": fp, "reload": {"id": reload_id} if reload_id else None},
            "workers": [{"id": i, "state": s, "fingerprint": f, "pid": pid, "registrations": reg}
                        for i, s, f, pid, reg in workers]}


def test_reading_a_reload_from_the_status():
    from laya_pool.broker import reload as rl
    A, B = "a" * 64, "b" * 64
    start = _st(A, ("0", "ready", A, 10, 1), ("1", "ready", A, 11, 1))
    before = {w["id"]: w for w in start["workers"]}
    assert not rl.moved(start, before, B) and rl.problem(start, before, B, "r1") is None
    # worker 0 moved, the broker switched, worker 1 is stopped between its stop and its start: not finished
    mid = _st(B, ("0", "ready", B, 20, 2), ("1", "stopped", A, 11, 1), reload_id="r1")
    assert set(rl.moved(mid, before, B)) == {"0"} and rl.all_on(mid, B)
    assert not rl.finished(mid, before, B, {"0"})
    end = _st(B, ("0", "ready", B, 20, 2), ("1", "ready", B, 21, 2), reload_id="r1")
    assert rl.finished(end, before, B, {"0", "1"}) and rl.problem(end, before, B, "r1") is None
    # rolled back: worker 0 registered again on the old model
    back = _st(A, ("0", "ready", A, 30, 2), ("1", "ready", A, 11, 1), reload_id="r1")
    assert "worker 0 registered again on model aaaaaaaaaaaa" in rl.problem(back, before, B, "r1")
    assert "another reload" in rl.problem(_st(A, reload_id="r2"), before, B, "r1")


def test_the_broker_serves_the_new_model_once_half_the_ready_workers_have_it(tmp_path):
    from laya_pool.broker.broker import Broker, BrokerConfig
    from laya_pool.broker.table import WorkerInfo
    from laya_pool.protocol.contract import WorkerState
    A, B = "a" * 64, "b" * 64
    b = Broker(BrokerConfig(frontend=f"ipc://{tmp_path}/fe", backend=f"ipc://{tmp_path}/be", fingerprint=A,
                            operator_secret=False))
    try:
        t = b.table
        for i in "012":
            t.workers[i] = WorkerInfo(id=i, identity=i.encode(), fingerprint=A)
        t.reload = {"id": "r", "model": "/m", "fingerprint": B, "previous": A}
        t.workers["0"].fingerprint, t.workers["0"].state = B, WorkerState.MISMATCH    # 1 new, 2 old
        b.dispatcher.switch_model()
        assert t.pool_fp == A and [w.id for w in t.serving()] == ["1", "2"]
        t.workers["1"].fingerprint, t.workers["1"].state = B, WorkerState.MISMATCH    # 2 new, 1 old
        b.dispatcher.switch_model()
        assert t.pool_fp == B == b.cfg.fingerprint and [w.id for w in t.serving()] == ["0", "1"]
        assert t.workers["2"].state is WorkerState.MISMATCH                            # waits for its turn
    finally:
        b.shutdown()
