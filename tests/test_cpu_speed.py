"""scripts/cpu_speed.py's pure part: which pairs of CPUs slow each other."""


from scripts import cpu_speed


def test_only_pairs_past_the_threshold_are_named_with_their_ratio():
    alone = {0: 100.0, 1: 200.0, 2: 100.0}
    beside = {(0, 1): 170.0, (1, 0): 220.0, (0, 2): 114.0, (2, 0): 115.0}
    assert cpu_speed.slowed_pairs(alone, beside) == [(0, 1, 1.7), (2, 0, 1.15)]


def test_phases_are_runs_of_fast_and_slow_samples():
    # fast until 0.2 s, slow (x2) until 0.5 s, fast again (median of 3 around each sample): two changes; runs of 0.2,
    # 0.3 and 0.1001 s (the last sample lasts its own 100 us)
    series = [(0.0, 100.0), (0.1, 110.0), (0.2, 200.0), (0.3, 210.0), (0.4, 205.0), (0.5, 100.0), (0.6, 100.0)]
    p = cpu_speed.phases(series, fastest=100.0, window=3)
    assert p["changes"] == 2
    assert p["median_run_s"] == 0.2
    assert p["fast_share"] == round(0.3001 / 0.6001, 3)


def test_one_slow_sample_among_fast_ones_is_no_phase():
    series = [(i * 0.01, 300.0 if i == 5 else 100.0) for i in range(10)]
    assert cpu_speed.phases(series, fastest=100.0)["changes"] == 0
    assert cpu_speed.phases(series, fastest=100.0, window=1)["changes"] == 2


def test_a_cpu_that_never_changes_speed_has_one_run():
    series = [(i * 0.01, 150.0) for i in range(50)]
    assert cpu_speed.phases(series, fastest=100.0) == {"fast_share": 0.0, "changes": 0, "median_run_s": 0.49}
