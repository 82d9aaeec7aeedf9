"""scripts/cpu_speed.py's pure part: which pairs of CPUs slow each other."""
import sys

from conftest import ROOT

sys.path.append(str(ROOT))
from scripts import cpu_speed  # noqa: E402


def test_only_pairs_past_the_threshold_are_named_with_their_ratio():
    alone = {0: 100.0, 1: 200.0, 2: 100.0}
    beside = {(0, 1): 170.0, (1, 0): 220.0, (0, 2): 114.0, (2, 0): 115.0}
    assert cpu_speed.slowed_pairs(alone, beside) == [(0, 1, 1.7), (2, 0, 1.15)]
