"""`laya-pool workers`: this host's workers joining a broker on another host, tested on one machine as three hosts.

One `laya-pool broker --keys` on 127.0.0.2 and two `laya-pool workers` supervisors ("hosts" A on 127.0.0.3 and B on
127.0.0.4, each with a CPU worker whose direct socket listens on its host's address), all over tcp with CURVE. Under
load from clients that send straight to the workers: a worker killed alone comes back (its supervisor's backoff); a
whole host killed (SIGKILL: the supervisor and its worker) loses no request, its worker is dead in the broker's status
within the liveness window, and it is back when the supervisor starts again; SIGTERM drains both hosts (exit 0).
The rules around it (ids, direct sockets, readiness, refusals) are tested alone first.
"""
from __future__ import annotations

import json
import logging
import os
import resource
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from conftest import ROOT, SUBPROCESS_ENV, LoadThreads, free_port, make_rows, reference_logits, wait_until
from prometheus_client.parser import text_string_to_metric_families

from laya_pool import Client, PoolError
from laya_pool.broker import remote
from laya_pool.broker.host import HostView, readiness
from laya_pool.broker.processes import WorkerProcesses
from laya_pool.protocol import contract, lifecycle

HB_MS, LIVENESS = 200, 3
# The workers take clients' requests on their direct sockets as GPU workers do by default (a CPU worker does not), over
# tcp with CURVE as from another host (no shared-memory lanes).
HOST_ENV = dict(SUBPROCESS_ENV, LAYA_DATA_REQUESTS="on", LAYA_DIRECT="on", LAYA_LANES="off")


# ------------------------------------------------------------------------------------------------ the rules alone

def test_a_host_is_ready_when_every_worker_meant_to_run_is_registered():
    view = HostView({"h-0": "registered", "h-1": "starting"}, {"h-0": "cuda:0", "h-1": "cuda:1"}, {"h-0": 0, "h-1": 0})
    ready, body = readiness(view)
    assert not ready and body["why"] == "not registered with the broker yet: h-1" and body["registered_workers"] == 1
    view.states["h-1"] = "registered"
    assert readiness(view)[0]
    view.states["h-1"] = "down"                      # drained by an operator: not waited for
    assert readiness(view)[0]
    view.states["h-0"] = "down"
    assert "no worker of this host can run" in readiness(view)[1]["why"]
    view.states["h-0"], view.stopping = "registered", True
    assert readiness(view) == (False, {"ready": False, "registered_workers": 1, "why": "this host's workers are "
                                       "stopping", "workers": {"h-0": "registered", "h-1": "down"}})


def test_a_hosts_workers_are_named_by_it_and_say_where_the_broker_has_them(tmp_path):
    cfg = remote.WorkersConfig(model="/m", devices=["cuda:0", "cuda:1"], workers_per_device=2,
                               broker="tcp://10.1.2.3:5556", name="gpu7", keys="/k", worker_args=["--threads", "2"])
    procs = WorkerProcesses(cfg, cfg.broker, {}, name=cfg.name, direct="tcp://10.1.2.9:*", presence_dir=tmp_path)
    assert list(procs.children) == ["gpu7-0", "gpu7-1", "gpu7-2", "gpu7-3"]
    argv = procs.children["gpu7-2"].argv
    flags = dict(zip(argv[3::2], argv[4::2]))
    assert (flags["--backend"], flags["--id"], flags["--device"], flags["--keys"], flags["--direct-endpoint"],
            flags["--presence-file"], flags["--threads"]) == (
        "tcp://10.1.2.3:5556", "gpu7-2", "cuda:1", "/k", "tcp://10.1.2.9:*", str(tmp_path / "gpu7-2.json"), "2")
    assert procs.children["gpu7-2"].env["CUDA_VISIBLE_DEVICES"] == "1"
    assert procs.states() == {w: "starting" for w in procs.children}     # not started: its process' state


def test_a_worker_that_cannot_be_spawned_waits_out_its_backoff_and_is_started_again(tmp_path, caplog):
    """children.start, which `up` and `laya-pool workers` share: a spawn out of file descriptors (the real Popen, this
    process's open-files limit lowered to its lowest free descriptor) is logged with what to do and waits out its
    backoff, as after a crash; once descriptors are to be had again, the round after the backoff starts it."""
    cfg = remote.WorkersConfig(model="/m", devices=["cpu"], broker="tcp://127.0.0.2:5556", name="h")
    procs = WorkerProcesses(cfg, cfg.broker, {}, name=cfg.name, presence_dir=tmp_path)
    child = procs.children["h-0"]
    child.argv = [sys.executable, "-c", "import sys; sys.exit(0)"]     # a child that starts and leaves at once
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    used = {int(fd) for fd in os.listdir("/proc/self/fd")}
    caplog.set_level(logging.INFO, logger="laya-pool.supervisor")
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(set(range(len(used) + 1)) - used), hard))
    try:
        failed_at = time.monotonic()
        procs.start_all()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert (child.state, child.proc, child.restarts) == ("backoff", None, 0)
    assert child.next_start >= failed_at + lifecycle.BACKOFF_START and child.backoff == 2 * lifecycle.BACKOFF_START
    said = [r.getMessage() for r in caplog.records if "could not start worker h-0" in r.getMessage()]
    assert len(said) == 1 and "out of file descriptors: raise `ulimit -n`" in said[0], said
    assert "trying again in 0.5 s" in said[0], said
    procs.restart_due()
    assert child.state == "backoff" and child.proc is None            # not before its backoff
    wait_until(lambda: procs.restart_due() or child.state == "running", 5, "it was not started again")
    assert child.proc.wait(10) == 0 and procs.states() == {"h-0": "running"}
    procs.reap(stopping=False)
    assert procs.states() == {"h-0": "down"}                           # (exit 0: it drained and left)


def test_direct_sockets_listen_where_clients_reach_the_host():
    cfg = remote.WorkersConfig(model="/m", devices=["cpu"], broker="tcp://127.0.0.2:5556", keys="/k")
    assert remote.direct_endpoint(cfg, {}) is None                 # a broker on loopback: the worker's own default
    cfg.broker = "tcp://127.0.0.2:5556"
    cfg.direct_host = "127.0.0.3"
    assert remote.direct_endpoint(cfg, {}) == "tcp://127.0.0.3:*"
    cfg.direct_host = "fd00::5"
    assert remote.direct_endpoint(cfg, {}) == "tcp://[fd00::5]:*"
    assert remote.direct_endpoint(cfg, {"LAYA_DIRECT_ENDPOINT": "tcp://127.0.0.9:*"}) is None    # chosen: it wins
    assert remote.route_address("tcp://127.0.0.2:5556") == "127.0.0.1"     # the source address towards that host
    cfg.direct_host, cfg.broker = None, "tcp://broker.invalid:5556"      # a name that resolves to nothing
    with pytest.raises(OSError, match="give --direct-host"):
        remote.direct_endpoint(cfg, {})


def _workers_cli(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laya_pool", "workers", *args], env=SUBPROCESS_ENV, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_workers_refuses_what_cannot_work(tiny_ckpt, tmp_path):
    r = _workers_cli("--broker", "tcp://10.9.9.9:5556", "--model", str(tiny_ckpt))
    assert r.returncode == contract.EXIT_USAGE and "--broker tcp://10.9.9.9:5556" in r.stderr and "--keys" in r.stderr
    r = _workers_cli("--broker", "tcp://127.0.0.2:5556", "--model", str(tiny_ckpt), "--name", "a/b")
    assert r.returncode == contract.EXIT_USAGE and "--name" in r.stderr
    r = _workers_cli("--broker", "tcp://127.0.0.2:5556", "--model", str(tmp_path))
    assert r.returncode == contract.EXIT_USAGE and "--model" in r.stderr
    r = _workers_cli("--broker", "tcp://127.0.0.2:5556", "--model", str(tiny_ckpt), "--http", "0.0.0.0:9")
    assert r.returncode == contract.EXIT_USAGE and "--http" in r.stderr
    r = _workers_cli("--broker", "127.0.0.2:5556", "--model", str(tiny_ckpt))
    assert r.returncode == contract.EXIT_USAGE and "--broker" in r.stderr


def test_workers_that_cannot_load_the_model_stop_the_host_with_78(tiny_ckpt, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in contract.FINGERPRINT_FILES:
        (bad / f).parent.mkdir(parents=True, exist_ok=True)
        (bad / f).write_bytes((tiny_ckpt / f).read_bytes())
    (bad / "model.safetensors").write_bytes(b"not a safetensors file")
    r = _workers_cli("--broker", f"tcp://127.0.0.2:{free_port()}", "--model", str(bad), "--threads", "1",
                     timeout=120)
    assert r.returncode == contract.EXIT_CONFIG, r.stderr[-2000:]
    assert "no worker can start" in r.stderr and "restarting in" not in r.stderr


# ------------------------------------------------------------------------------------------------ three hosts

def _get(address: str, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://{address}{path}", timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


def _metric(address: str, name: str, labels: dict[str, str]) -> float | None:
    code, text = _get(address, "/metrics")
    for fam in text_string_to_metric_families(text) if code == 200 else []:
        for s in fam.samples:
            if s.name == name and s.labels == labels:
                return s.value
    return None


class _Host:
    """One `laya-pool workers` supervisor, as a host of its own: its name, address, --http."""

    def __init__(self, name: str, address: str, backend: str, keys, ckpt, log_dir):
        self.name, self.address = name, address
        self.http = f"{address}:{free_port()}"
        self.argv = [sys.executable, "-m", "laya_pool", "workers", "--broker", backend, "--model", str(ckpt),
                     "--keys", str(keys), "--name", name, "--direct-host", address, "--http", self.http,
                     "--heartbeat-ms", str(HB_MS), "--liveness", str(LIVENESS), "--threads", "1"]
        self.log = open(log_dir / f"{name}.log", "ab")
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(self.argv, env=HOST_ENV, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def ready(self) -> dict | None:
        code, body = _get(self.http, "/health/ready")
        return json.loads(body) if code == 200 else None


class _Load(LoadThreads):
    """Client threads (with the pool's keys: their first attempts go to the workers' direct sockets), every answer
    checked against the runtime, until stopped."""

    JOIN_S = 30.0

    def __init__(self, frontend: str, keys, cases: list, want: list):
        self.frontend, self.keys, self.cases, self.want = frontend, str(keys), cases, want
        self.stop = threading.Event()
        self.answers: list[str] = []
        self.errors: list[str] = []
        self.direct = 0           # first attempts that went to a worker's direct socket
        self.threads = [threading.Thread(target=self._run, args=(k,), daemon=True) for k in range(3)]

    def _run(self, k: int) -> None:
        with Client(self.frontend, keys=self.keys, timeout=10.0, retries=8) as c:
            self._calls(c, k)
            self.direct += c._routes.sent

    def _calls(self, c: Client, k: int) -> None:
        i = k
        while not self.stop.is_set():
            try:
                res = c.forward(self.cases[i % 3])
                np.testing.assert_allclose(res.flat, self.want[i % 3], rtol=1e-5, atol=1e-5)
                self.answers.append(res.worker)
            except Exception as e:  # noqa: BLE001 - every failure is the test's
                self.errors.append(repr(e))
            i += 1

    def more(self, n: int, within: float, what: str, by: str | None = None) -> None:
        """`n` more answers (by worker `by`, if given), none failed."""
        def count() -> int:
            return len(self.answers) if by is None else self.answers.count(by)
        base = count()
        wait_until(lambda: not self.errors and count() >= base + n, within, lambda: f"{what}: errors {self.errors[:3]}")


def _rows(c: Client) -> dict[str, dict]:
    return {w["id"]: w for w in c.status()["workers"]}


@pytest.mark.timeout(150)
def test_two_hosts_of_workers_one_lost_under_load_and_back(tiny_ckpt, tiny_runtime, tmp_path):
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "laya_pool", "keys", "--out", str(keys)], env=SUBPROCESS_ENV, check=True,
                   capture_output=True)
    frontend, backend = f"tcp://127.0.0.2:{free_port()}", f"tcp://127.0.0.2:{free_port()}"
    broker = subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", frontend, "--backend",
                               backend, "--keys", str(keys), "--heartbeat-ms", str(HB_MS), "--liveness",
                               str(LIVENESS)], env=SUBPROCESS_ENV, cwd=ROOT,
                              stdout=open(tmp_path / "broker.log", "wb"), stderr=subprocess.STDOUT)
    a, b = (_Host(n, addr, backend, keys, tiny_ckpt, tmp_path) for n, addr in (("hostA", "127.0.0.3"),
                                                                                ("hostB", "127.0.0.4")))
    cases = [make_rows(400 + i, 2, length=40) for i in range(3)]
    want = [reference_logits(tiny_runtime, r) for r in cases]
    try:
        a.start()
        b.start()
        with Client(frontend, keys=str(keys), timeout=3.0, retries=0) as c:
            wait_until(lambda: a.ready() and b.ready(), 90, "the two hosts' workers did not register", interval=0.3)
            rows = _rows(c)
            assert {w: rows[w]["state"] for w in rows} == {"hostA-0": "ready", "hostB-0": "ready"}
            assert rows["hostA-0"]["direct"].startswith("tcp://127.0.0.3:")    # where clients reach host A
            with _Load(frontend, keys, cases, want) as load:
                load.more(6, 60, "the pool did not answer")
                _a_worker_killed_alone_comes_back(c, b, load)
                _a_host_lost_and_back(c, a, load)
            assert not load.errors, load.errors[:3]
            assert load.answers.count("hostA-0") and load.answers.count("hostB-0")
            assert load.direct > 0          # the clients sent to the workers themselves (tcp + CURVE), not only routed
        _both_drain_on_sigterm(frontend, keys, a, b)
    finally:
        for p in (a.proc, b.proc, broker):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(10)


def _a_worker_killed_alone_comes_back(c: Client, host: _Host, load: _Load) -> None:
    """Host B's worker killed (not its supervisor): restarted after the backoff, registered again, counted."""
    before = _rows(c)["hostB-0"]
    os.kill(before["pid"], signal.SIGKILL)
    wait_until(lambda: _rows(c)["hostB-0"]["registrations"] > before["registrations"]
               and _rows(c)["hostB-0"]["state"] == "ready", 60, "host B's worker did not come back", interval=0.2)
    wait_until(lambda: _metric(host.http, "laya_pool_worker_restarts_total", {"worker": "hostB-0"}) == 1.0, 10,
               "host B did not count the restart")
    load.more(4, 60, "the pool stopped answering after host B's worker came back", by="hostB-0")


def _a_host_lost_and_back(c: Client, host: _Host, load: _Load) -> None:
    """Host A killed whole (SIGKILL: supervisor and worker): no request lost, its worker dead in the broker's status
    within the liveness window, back when the supervisor starts again."""
    load.more(3, 60, "host A's worker answered nothing", by="hostA-0")
    before = _rows(c)["hostA-0"]
    os.kill(host.proc.pid, signal.SIGKILL)
    os.kill(before["pid"], signal.SIGKILL)
    lost = time.monotonic()
    wait_until(lambda: _rows(c)["hostA-0"]["state"] == "dead", 10, "host A's worker stayed in the table",
               interval=0.02)
    window, took = HB_MS / 1000 * LIVENESS, time.monotonic() - lost
    print(f"host A's worker dead in the broker's status {took:.2f} s after the kill (liveness window {window:g} s)")
    assert took <= window + 1.0, f"dead after {took:.2f} s (window {window:g} s)"
    host.proc.wait(10)
    load.more(10, 60, "the pool stopped answering when host A was lost")
    host.start()
    wait_until(host.ready, 90, "host A did not come back ready", interval=0.3)
    back = _rows(c)["hostA-0"]
    assert back["state"] == "ready" and back["registrations"] == before["registrations"] + 1
    load.more(3, 60, "host A's worker got nothing after it came back", by="hostA-0")


def _both_drain_on_sigterm(frontend: str, keys, a: _Host, b: _Host) -> None:
    for host in (a, b):
        host.proc.send_signal(signal.SIGTERM)
    assert [host.proc.wait(20) for host in (a, b)] == [0, 0]
    with Client(frontend, keys=str(keys), timeout=3.0) as c:
        try:
            rows = _rows(c)
        except PoolError as e:
            pytest.fail(f"the broker stopped answering: {e}")
    assert {w: r["state"] for w, r in rows.items()} == {"hostA-0": "stopped", "hostB-0": "stopped"}
