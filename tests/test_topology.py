"""tools/topology.py: each path it times carries the message there and back (real processes and sockets)."""
from __future__ import annotations

import multiprocessing
import os

import pytest
from conftest import free_port
from laya_pool.tools import topology


@pytest.mark.parametrize("path,handoff", [("broker", True), ("direct", False)])
def test_each_path_answers_with_the_message_sent(path, handoff):
    got = topology.measure(path, handoff, 0.0, (free_port(), free_port()), samples=30, warmup=5, size=64)
    assert 0 < got["p50"] <= got["p95"] < 1000


def test_an_answer_other_than_the_one_expected_stops_the_run():
    """The harness fails on a planted difference: told to expect other bytes, it raises instead of timing."""
    with pytest.raises(RuntimeError, match="not the message sent"):
        topology.measure("broker", True, 0.0, (free_port(), free_port()), samples=5, warmup=0, size=64,
                         expect=b"\x01" * 64)


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_the_idle_spinners_run_at_the_lowest_class_and_are_gone_after():
    with topology.idle_spinners() as ok:
        assert ok
        spinners = multiprocessing.active_children()
        assert len(spinners) == len(os.sched_getaffinity(0))
        assert all(os.sched_getscheduler(p.pid) == os.SCHED_IDLE for p in spinners)
    assert not any(p.is_alive() for p in spinners)
