"""scripts/procview.py: what /proc says a window cost each thread and each CPU (round_trip.py --host)."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from scripts import procview

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="needs Linux /proc")


def test_a_spinning_thread_is_the_busiest_and_a_sleeping_one_switches_voluntarily():
    stop = threading.Event()
    tids: dict[str, int] = {}

    def spin() -> None:
        tids["spin"] = threading.get_native_id()
        while not stop.is_set():
            pass

    def nap() -> None:
        tids["nap"] = threading.get_native_id()
        while not stop.wait(0.005):
            pass

    threads = [threading.Thread(target=spin), threading.Thread(target=nap)]
    for t in threads:
        t.start()
    while len(tids) < 2:
        time.sleep(0.001)
    pid = os.getpid()
    with procview.Sampler([pid]) as sampler:
        before = procview.read_threads(pid)
        time.sleep(0.4)
        after = procview.read_threads(pid)
    stop.set()
    for t in threads:
        t.join()
    seen = {tid: cpus for (p, tid), cpus in sampler.seen.items() if p == pid}
    rows = {r["tid"]: r for r in procview.thread_report(before, after, 10, seen)}
    spin_cpu = rows[tids["spin"]]["cpu_us_per_call"] * 10 / 1e6
    assert spin_cpu > 0.1, rows[tids["spin"]]            # (the GIL shares 0.4 s among this test's threads)
    assert rows[tids["nap"]]["cpu_us_per_call"] < rows[tids["spin"]]["cpu_us_per_call"]
    assert rows[tids["nap"]]["voluntary_per_call"] * 10 >= 20     # ~80 naps of 5 ms
    assert sum(seen[tids["spin"]].values()) >= 5                 # sampled every 20 ms


def test_a_command_name_with_spaces_and_parentheses_is_skipped_whole():
    fields = ["S"] + ["0"] * 10 + ["250", "50"] + ["0"] * 23 + ["7"] + ["0"] * 5
    stat = "4242 (a) b (c)) " + " ".join(fields)
    status = "Name:\tx\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n"
    t = procview.parse_thread(stat, status)
    assert (t.cpu_s, t.voluntary, t.involuntary, t.processor, t.name) == (300 * procview.TICK_S, 12, 3, 7,
                                                                          "a) b (c)")


def test_cpu_shares_count_steal_apart_from_busy_and_idle():
    before = "cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 100 0 50 800 0 0 0 50 0 0\ncpu1 0 0 0 1000 0 0 0 0 0 0\nintr 5\n"
    after = "cpu  1 1 1 1 1 1 1 1 0 0\ncpu0 130 0 60 850 10 0 0 100 0 0\ncpu1 50 0 0 1050 0 0 0 0 0 0\nintr 9\n"
    report = procview.cpu_report(procview.parse_cpus(before), procview.parse_cpus(after))
    # cpu0: busy 40, idle 60 (iowait counts idle), steal 50 of 150 ticks; cpu1: busy 50 of 100
    assert report == {0: {"busy_pct": 26.7, "steal_pct": 33.3}, 1: {"busy_pct": 50.0, "steal_pct": 0.0}}


def test_each_cpus_clock_is_read_from_its_own_block():
    text = "processor\t: 0\nmodel name\t: x\ncpu MHz\t\t: 2596.130\n\nprocessor\t: 1\ncpu MHz\t\t: 3100.5\n"
    assert procview.parse_mhz(text) == {0: 2596.13, 1: 3100.5}
    assert set(procview.parse_mhz(Path("/proc/cpuinfo").read_text())) <= set(procview.read_cpus())
