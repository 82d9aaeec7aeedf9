"""worker/placement.py's choice of a CPU for the data thread: the pure pick, and the timing on this machine's CPUs."""
import os
import threading

import pytest
from laya_pool.worker import placement


def test_quickest_is_the_least_time_and_the_lower_number_on_a_tie():
    assert placement.quickest({0: 9.0, 1: 5.0, 2: 7.0}) == 1
    assert placement.quickest({4: 5.0, 2: 5.0, 3: 6.0}) == 2
    assert placement.quickest({}) is None


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_every_allowed_cpu_is_timed_at_once():
    cpus = sorted(os.sched_getaffinity(0))
    speeds = placement.cpu_speeds(cpus, seconds=0.2)
    assert sorted(speeds) == cpus
    assert all(v > 0 for v in speeds.values())
    assert placement.cpu_speeds([max(cpus) + 4096], seconds=0.1) == {}     # a CPU the process may not use


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="needs Linux affinity")
def test_pin_thread_pins_the_calling_thread_alone():
    cpus = sorted(os.sched_getaffinity(0))
    seen = {}

    def pinned():
        seen["ok"] = placement.pin_thread(cpus[-1])
        seen["thread"] = os.sched_getaffinity(0)

    t = threading.Thread(target=pinned)
    t.start()
    t.join()
    assert seen == {"ok": True, "thread": {cpus[-1]}}
    assert sorted(os.sched_getaffinity(0)) == cpus          # the caller's own affinity is untouched
