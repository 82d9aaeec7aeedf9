"""The shared test helpers hold what the other tests lean on."""
from __future__ import annotations

import numpy as np
import pytest
from conftest import make_rows, wait_until

from laya_pool.worker.batch import Batch, Limits, validate


def test_wait_until_returns_the_first_truthy_value_and_fails_with_the_message():
    calls = iter([0, None, "", 7, 8])
    assert wait_until(lambda: next(calls), 5, "never", interval=0) == 7
    with pytest.raises(pytest.fail.Exception, match="after 0.05 s: still nothing"):
        wait_until(lambda: False, 0.05, lambda: "still nothing", interval=0.01)


def test_wait_until_ignores_only_the_named_errors():
    seen = []

    def flaky():
        seen.append(1)
        if len(seen) < 3:
            raise ConnectionError("not yet")
        return True

    assert wait_until(flaky, 5, "never", interval=0, ignore=(ConnectionError,)) and len(seen) == 3
    with pytest.raises(KeyError):
        wait_until(lambda: {}["x"], 5, "never", ignore=(ConnectionError,))


@pytest.mark.parametrize("kw", [{}, {"n": 7, "length": (8, 120), "markers": (1, 6)}, {"n": 16, "length": 256},
                                {"n": 1, "length": 2, "markers": 5}])
def test_make_rows_are_valid_requests_and_repeatable(kw):
    rows = make_rows(3, **kw)
    validate(Batch.from_rows(rows), Limits(vocab_size=1000, max_len=512, max_tokens=1 << 16, max_rows=64,
                                           max_markers=1024))
    assert [q for _, _, q in rows] == [i % 3 for i in range(len(rows))]
    again = make_rows(3, **kw)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(rows, again))
