"""worker/pace.py: when a group that is not full launches behind a computing one (pure logic, times given)."""
from __future__ import annotations

import pytest
from laya_pool.worker.pace import LEAD_MS, Pace, lead_from_env


def test_nothing_changes_until_a_group_was_timed_or_with_no_lead():
    pace = Pace(lead_s=0.0003)
    assert pace.launch_by(1.0) is None                    # no group timed yet: launch once the one ahead landed
    pace.landed(launched=1.0, landed=1.003)
    assert Pace(lead_s=0.0).launch_by(1.0) is None
    off = Pace(lead_s=0.0)
    off.landed(1.0, 1.003)
    assert off.launch_by(2.0) is None


def test_a_group_launched_behind_another_is_timed_from_that_ones_landing():
    """Group A launched at 0 lands at 3 ms; group B, launched at 1 ms while A computed, could only start at 3 ms and
    lands at 6 ms: B kept the device 3 ms, not 5 (timing it from its launch would make the estimate grow with the
    depth of the queue, and launch the next group too late)."""
    pace = Pace(lead_s=0.0005, weight=1.0)
    pace.landed(launched=0.0, landed=0.003)
    assert pace.group_s == pytest.approx(0.003)
    pace.landed(launched=0.001, landed=0.006)
    assert pace.group_s == pytest.approx(0.003)
    # C launched at 6.2 ms with the device idle (nothing ahead): expected to land at 9.2 ms, launch the next by 8.7
    assert pace.launch_by(0.0062) == pytest.approx(0.0062 + 0.003 - 0.0005)
    # D launched at 5 ms, before B landed at 6: it starts at 6, so the next launches by 6 + 3 - 0.5 ms
    assert pace.launch_by(0.005) == pytest.approx(0.006 + 0.003 - 0.0005)


def test_the_estimate_follows_the_groups_smoothly():
    pace = Pace(lead_s=0.0003, weight=0.25)
    pace.landed(0.0, 0.004)
    pace.landed(0.004, 0.006)                              # 2 ms: the estimate moves a quarter of the way
    assert pace.group_s == pytest.approx(0.004 + 0.25 * (0.002 - 0.004))
    before = pace.group_s
    pace.landed(0.005, 0.005)                              # landed no later than it could start: no sample
    assert pace.group_s == before and pace.last_landed == 0.005


def test_the_lead_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("LAYA_LAUNCH_LEAD_MS", raising=False)
    assert lead_from_env() == pytest.approx(LEAD_MS / 1e3)
    monkeypatch.setenv("LAYA_LAUNCH_LEAD_MS", "0")
    assert lead_from_env() == 0.0
    monkeypatch.setenv("LAYA_LAUNCH_LEAD_MS", "0.5")
    assert lead_from_env() == pytest.approx(0.0005)
    monkeypatch.setenv("LAYA_LAUNCH_LEAD_MS", "-1")
    with pytest.raises(ValueError, match="LAYA_LAUNCH_LEAD_MS"):
        lead_from_env()
