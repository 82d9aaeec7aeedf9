"""tools/topology.py: each path it times carries the message there and back (real processes and sockets)."""
from __future__ import annotations

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
