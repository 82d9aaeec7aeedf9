"""worker/placement.py's pin of one thread (the data thread's --data-cpu)."""
import os
import threading

import pytest

from laya_pool.worker import placement


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
