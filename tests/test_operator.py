"""Operator commands need the operator credential; restarts are rate-limited; the pool keeps serving.

A loopback pool (`laya-pool up`, two CPU workers): a plain `Client` (what any local process can open) is
refused a drain with a clear "not allowed" naming the field; the operator's client (the secret the broker
wrote, owner-only) and the `laya-pool` CLI are not; a second restart inside the window is refused.
"""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, make_rows, wait_until

from laya_pool.broker import operator
from laya_pool.client.errors import RequestFailed
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.protocol.contract import Reason

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(180)


def _states(pool) -> dict[str, str]:
    return {w["id"]: w["state"] for w in pool.status()["workers"]}


def test_only_the_operator_may_drain_or_restart_and_restarts_are_limited(tiny_ckpt):
    with local_pool(tiny_ckpt, "cpu", workers_per_device=2, heartbeat_ms=250, liveness=4,
                    extra_args=["--max-restarts", "1", "--restart-window", "600", "--threads", "1"]) as pool:
        path = operator.secret_path(pool.endpoint)
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, "the operator secret must be owner-only"
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        rows = make_rows(1, 2)
        with Client(pool.endpoint, timeout=10.0) as plain:
            for restart in (False, True):
                with pytest.raises(RequestFailed) as e:
                    plain.drain("0", restart=restart)
                assert e.value.reason == Reason.NOT_ALLOWED and e.value.field == "op"
                assert "not allowed" in str(e.value) and "laya-pool drain" in str(e.value)
            assert _states(pool) == {"0": "ready", "1": "ready"}, "a refused drain must change nothing"
            assert len(plain.forward(rows).logits) == 2, "the pool keeps serving the refused client"

            with Client(pool.endpoint, timeout=10.0, operator=operator.read_secret(pool.endpoint)) as op:
                with pytest.raises(RequestFailed) as e:
                    op.drain("nope")
                assert e.value.field == "worker", "the operator is told which field is wrong"
                assert op.drain("0", restart=True)["state"] == "draining"
                assert op.drain("0", restart=True)["restart"], "a repeat for a worker on its way back is free"
                with pytest.raises(RequestFailed) as e:
                    op.drain("1", restart=True)
                assert e.value.reason == Reason.RATE_LIMITED and "try again in" in str(e.value)
            # The operator's CLI reads the secret by itself.
            r = subprocess.run([sys.executable, "-m", "laya_pool", "drain", "1", "--wait", "--frontend",
                                pool.endpoint], env=SUBPROCESS_ENV, cwd=ROOT, capture_output=True, text=True,
                               timeout=60)
            assert r.returncode == 0, r.stderr
            wait_until(lambda: _states(pool) == {"0": "ready", "1": "drained"}, 60,
                       lambda: f"worker 0 back, worker 1 drained: {_states(pool)}")
            assert len(plain.forward(rows).logits) == 2
        log = pool.log()
        assert log.count("refused a drain/restart from a peer without the operator credential") == 1, \
            "two refusals in a row log one line (rate-limited)"


def test_secret_files_are_private_and_removed_only_by_their_owner(tmp_path, monkeypatch):
    monkeypatch.setenv(operator.SECRET_ENV, str(tmp_path / "run"))
    token, path = operator.publish_secret("ipc:///x")
    assert operator.read_secret("ipc:///x") == token and operator.read_secret("ipc:///y") is None
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    newer, _ = operator.publish_secret("ipc:///x")        # a new broker on the same endpoint
    operator.remove_secret(path, token)                   # the old one stopping must not remove the new secret
    assert operator.read_secret("ipc:///x") == newer
    operator.remove_secret(path, newer)
    assert not path.exists()
    assert not operator.token_matches(None, newer) and not operator.token_matches("x", None)
    limit = operator.RestartLimit(2, 10.0)
    assert [limit.allow(t) for t in (0.0, 1.0)] == [0.0, 0.0] and limit.allow(2.0) == pytest.approx(8.0)
    assert limit.allow(10.5) == 0.0
