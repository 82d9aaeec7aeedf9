"""scripts/cpu_speed.py's pure part: which pairs of CPUs slow each other."""
import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("cpu_speed", Path(__file__).parents[1] / "scripts" / "cpu_speed.py")
cpu_speed = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_speed)


def test_only_pairs_past_the_threshold_are_named_with_their_ratio():
    alone = {0: 100.0, 1: 200.0, 2: 100.0}
    beside = {(0, 1): 170.0, (1, 0): 220.0, (0, 2): 114.0, (2, 0): 115.0}
    assert cpu_speed.slowed_pairs(alone, beside) == [(0, 1, 1.7), (2, 0, 1.15)]

