"""The operations surface's pure logic: the broker's meter, status snapshots -> metrics, readiness, --http parsing.

No processes here (tests/test_ops_http.py runs a pool); snapshots are built with the broker's own `Meter`, so
their shape is the one `status` ships.
"""
from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from laya_pool.broker.metering import Meter
from laya_pool.broker.observe import PoolObserver, Totals, readiness
from laya_pool.broker.ops_http import is_loopback_host, parse_listen, refusal
from laya_pool.protocol.histogram import Histogram


def _status(broker_pid: int, meter: Meter, counters: dict, workers: list[dict] | None = None) -> dict:
    return {"broker": {"pid": broker_pid, "queue": 2, "queue_size": 8, "inflight": 1, "counters": counters},
            "workers": workers if workers is not None else
            [{"id": "0", "device": "cpu", "state": "ready", "pid": 100, "inflight": 1, "credit": 2,
              "stats": {"ok": 9, "merged_runs": 1, "merged_requests": 3, "direct": 2, "lanes": 5,
                        "answer_seconds": {"bounds": [0.001, 0.01], "counts": [4, 3, 2], "sum": 0.5},
                        "runtime": {"cache": {"hits": 4, "misses": 1}}}}],
            "meter": meter.snapshot()}


def _scrape(obs: PoolObserver, now: float = 10.0) -> dict[tuple[str, tuple], float]:
    class C(Collector):
        def collect(self):
            return obs.families(now)
    reg = CollectorRegistry(auto_describe=False)
    reg.register(C())
    text = generate_latest(reg).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_histogram_buckets_are_prometheus_le():
    h = Histogram((1, 2))
    for v in (0.5, 1, 1.5, 2, 3):
        h.observe(v)
    assert h.counts == [2, 2, 1] and h.sum == 8.0


def test_totals_add_deltas_and_never_go_back():
    t = Totals()
    t.feed("x", {}, "a", 5)
    t.feed("x", {}, "a", 7)             # +2
    t.feed("x", {}, "b", 3)             # a new epoch (restarted process) counts from zero: +3
    t.feed("x", {}, "b", 1)             # went down within an epoch: a reset we did not see, +1
    t.feed("x", {}, "b", None)          # missing: ignored
    assert t.series("x") == [({}, 11)]   # 5 + 2 + 3 + 1


def test_counters_survive_a_broker_restart_and_a_worker_restart():
    m = Meter()
    for _ in range(3):
        m.answered("0", "ok", None, rows=2, tokens=50, request_s=0.01, worker_s=0.005,
                   metrics={"total_ms": 2.0, "batched": 1})
    m.refused("retryable", "busy")
    obs = PoolObserver(lambda: {"broker_restarts": 0, "worker_restarts": {"0": 0}})
    obs.update(_status(1, m, {"requests": 4, "busy": 1}), now=9.0)
    first = _scrape(obs)
    assert first[("laya_pool_requests_total", (("outcome", "ok"), ("reason", "")))] == 3
    assert first[("laya_pool_requests_total", (("outcome", "retryable"), ("reason", "busy")))] == 1
    assert first[("laya_pool_worker_tokens_total", (("worker", "0"),))] == 150
    assert first[("laya_pool_worker_graph_cache_total", (("event", "hits"), ("worker", "0")))] == 4
    assert first[("laya_pool_worker_taken_total", (("path", "lane"), ("worker", "0")))] == 5
    assert first[("laya_pool_worker_taken_total", (("path", "direct"), ("worker", "0")))] == 2
    assert first[("laya_pool_worker_answered_total", (("worker", "0"),))] == 9     # 3 through the broker, 6 not
    assert first[("laya_pool_worker_answer_seconds_bucket", (("le", "0.01"), ("worker", "0")))] == 7
    assert first[("laya_pool_worker_answer_seconds_count", (("worker", "0"),))] == 9
    assert first[("laya_pool_request_seconds_count", ())] == 3
    assert first[("laya_pool_batch_requests_bucket", (("le", "1.0"), ("worker", "0")))] == 3
    assert first[("laya_pool_queue_depth", ())] == 2

    # The broker restarts (new pid, its meter starts again) and the worker process was replaced (new pid).
    m2 = Meter()
    m2.answered("0", "ok", None, rows=1, tokens=10, request_s=0.02, worker_s=0.01, metrics={"total_ms": 3.0})
    worker = {"id": "0", "device": "cpu", "state": "ready", "pid": 101, "inflight": 0, "credit": 2,
              "stats": {"merged_runs": 0, "runtime": {"cache": {"hits": 1}}}}
    obs.update(_status(2, m2, {"requests": 1}, [worker]), now=9.5)
    second = _scrape(obs)
    assert second[("laya_pool_requests_total", (("outcome", "ok"), ("reason", "")))] == 4
    assert second[("laya_pool_request_messages_total", ())] == 5
    assert second[("laya_pool_worker_tokens_total", (("worker", "0"),))] == 160
    assert second[("laya_pool_worker_graph_cache_total", (("event", "hits"), ("worker", "0")))] == 5
    assert second[("laya_pool_request_seconds_count", ())] == 4
    for key, value in first.items():     # no counter, bucket or sum went backwards
        if key[0].endswith(("_total", "_bucket", "_count", "_sum")):
            assert second.get(key, 0) >= value, key


def test_readiness_says_why():
    ok = {"workers": [{"id": "0", "state": "ready"}, {"id": "1", "state": "draining"}]}
    assert readiness(ok, 1.0, 5.0, False) == (True, {"ready": True, "ready_workers": 1,
                                                      "workers": {"0": "ready", "1": "draining"}})
    none_ready = {"workers": [{"id": "0", "state": "drained"}]}
    assert readiness(none_ready, 1.0, 5.0, False)[1]["why"] == "no worker is ready"
    assert readiness({"workers": []}, 1.0, 5.0, False)[1]["why"] == "no worker has registered"
    assert "for 9.0 s" in readiness(ok, 9.0, 5.0, False)[1]["why"]
    assert readiness(None, 0.0, 5.0, False)[0] is False
    assert readiness(ok, 1.0, 5.0, True) == (False, {"ready": False, "why": "the pool is stopping"})


def test_a_stale_status_is_not_ready_and_broker_down():
    obs = PoolObserver()
    obs.update(_status(1, Meter(), {}), now=0.0)
    assert obs.readiness(1.0)[0] is True
    assert obs.readiness(60.0)[0] is False
    assert _scrape(obs, now=60.0)[("laya_pool_broker_up", ())] == 0


@pytest.mark.parametrize("value, expected", [("9100", ("127.0.0.1", 9100)), (":9100", ("127.0.0.1", 9100)),
                                             ("0.0.0.0:80", ("0.0.0.0", 80)), ("[::1]:9100", ("::1", 9100))])
def test_parse_listen(value, expected):
    assert parse_listen(value) == expected


def test_http_refuses_exposed_addresses_without_keys():
    assert is_loopback_host("127.0.0.2") and is_loopback_host("::1") and is_loopback_host("localhost")
    assert not is_loopback_host("0.0.0.0") and not is_loopback_host("metrics.example")
    assert refusal("9100", None) is None
    assert "no CURVE keys" in refusal("0.0.0.0:9100", None)
    assert refusal("0.0.0.0:9100", "/some/keys") is None
    assert "expected PORT" in refusal("host:port", None)
    with pytest.raises(ValueError):
        parse_listen("70000")
