"""broker/ratelimit.py alone: at most one event per cause a second, the count of those held back, said later."""
from __future__ import annotations

import pytest

from laya_pool.broker.ratelimit import MAX_CAUSES, RateLimit


def test_one_event_per_cause_per_interval_and_the_count_held_back():
    r = RateLimit(1.0)
    # (cause, now, expected): None held back, else how many were held back before it
    table = [("a", 0.0, 0), ("a", 0.1, None), ("a", 0.5, None), ("b", 0.5, 0), ("a", 0.99, None),
             ("a", 1.0, 3), ("b", 1.2, None), ("a", 1.5, None), ("b", 1.5, 1), ("a", 2.0, 1), ("a", 5.0, 0)]
    for cause, now, want in table:
        assert r.admit(cause, now) == want, (cause, now)


def test_a_count_is_said_when_its_cause_goes_quiet():
    r = RateLimit(1.0)
    assert r.admit("x", 10.0) == 0
    for t in (10.1, 10.2, 10.3):
        assert r.admit("x", t) is None
    assert r.due(10.5) == []                 # the interval is not over: nothing to say yet
    assert r.due(11.0) == [("x", 3)]
    assert r.due(20.0) == []                 # said once
    assert r.admit("x", 11.5) is None        # `due` counts as a line said at 11.0
    assert r.admit("x", 12.0) == 1


def test_causes_are_bounded():
    r = RateLimit(1.0)
    for i in range(MAX_CAUSES + 10):
        assert r.admit(f"c{i}", float(i)) == 0
    assert len(r.last) == MAX_CAUSES and "c0" not in r.last and f"c{MAX_CAUSES + 9}" in r.last


def test_the_interval_must_be_positive():
    with pytest.raises(ValueError, match="interval_s"):
        RateLimit(0)
