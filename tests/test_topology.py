"""benchmarks/topology.py: each path it times carries the message there and back (real processes and sockets)."""
from __future__ import annotations

import os

import pytest
import zmq
from conftest import free_port

from benchmarks import topology


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
    with topology.idle_spinners() as spinners:
        assert len(spinners) == len(os.sched_getaffinity(0))
        assert all(os.sched_getscheduler(p.pid) == os.SCHED_IDLE for p in spinners)
    assert not any(p.is_alive() for p in spinners)


def test_a_path_whose_port_is_taken_fails_before_timing():
    """A forwarder that cannot bind (the port is held here) stops the run with its exit code, not a timed echo
    from whoever holds the port."""
    ctx = zmq.Context.instance()
    taken = ctx.socket(zmq.ROUTER)
    port = taken.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(RuntimeError, match="did not start"):
            topology.measure("broker", True, 0.0, (port, free_port()), samples=5, warmup=0, size=64)
    finally:
        taken.close(0)
