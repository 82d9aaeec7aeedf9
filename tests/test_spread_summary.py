"""scripts/spread_summary.py: a run's line names its parts and where its busiest client and worker threads ran."""
import json

from scripts import spread_summary as summary


def thread(name, us, cpus):
    return {"tid": 1, "name": name, "cpu_us_per_call": us, "voluntary_per_call": 0.0, "involuntary_per_call": 0.0,
            "cpus": cpus}


def test_a_line_names_the_parts_and_the_busiest_threads_cpus(tmp_path):
    run = {"calls": 10, "on_lanes": 10, "us": {"total": [1190.4, 1300.0], "pickup": [14.2, 20.0],
                                                 "worker gap": [120.0, 200.0]},
           "host": {"threads": {"client": [thread("io", 3.0, {"2": 9}), thread("python3", 1200.0, {"5": 2, "9": 8})],
                                "worker 0": [thread("compute", 1100.0, {"12": 10}), thread("io", 1.0, {"5": 10})]}}}
    path = tmp_path / "spread3.json"
    path.write_text(json.dumps(run))
    text = summary.line(str(path), {"9": ("0", "0"), "12": ("1", "2")})
    assert text.startswith("spread3.json: total 1190 pickup 14;")
    assert "worker gap" not in text and "worker_gap" not in text
    assert "client python3@9 (n0/L3 0)" in text and "worker compute@12 (n1/L3 2)" in text


def test_a_run_without_host_threads_still_gives_its_parts(tmp_path):
    path = tmp_path / "spread1.json"
    path.write_text(json.dumps({"us": {"total": [6798.0, 7000.0]}}))
    assert summary.line(str(path), {}) == "spread1.json: total 6798; client - (n?/L3 ?), worker - (n?/L3 ?)"
