"""scripts/probe_timeline.py's accounting (pure: kernel intervals in, a table out), on intervals made up to cover its
cases; the device run gives it real ones."""
from __future__ import annotations

import json

from scripts import probe_timeline as timeline


def k(name: str, start: float, end: float) -> dict:
    return dict(name=f"_{name}_kernel", start=start, end=end, grid=())


LAYER = [k("layer_norm", 0, 2), k("gemm", 1, 6), k("attention", 5, 8), k("gemm", 7, 9),      # norm, QKV, attn, Wo
         k("layer_norm", 8.5, 10), k("gemm", 12, 15), k("gemm", 14, 20)]                   # norm, (idle), Wi, Wo_mlp


def test_gemms_are_named_by_their_place_in_a_layer():
    assert timeline.labels(LAYER) == ["layer_norm_kernel", "gemm qkv", "attention_kernel", "gemm wo",
                                      "layer_norm_kernel", "gemm wi", "gemm wo_mlp"]


def test_the_scorers_gemms_are_no_layers():
    tail = [k("gather_norm", 21, 22), k("gemm", 22, 23), k("gemm", 23, 24), k("features", 24, 25), k("gemm", 25, 26),
            k("gemm", 26, 27), k("softmax", 27, 28)]
    assert timeline.labels(LAYER + tail)[len(LAYER):] == ["gather_norm_kernel", "gemm tail", "gemm tail",
                                                          "features_kernel", "gemm tail", "gemm tail", "softmax_kernel"]


def test_what_each_kernel_adds_to_the_span_sums_to_the_span():
    """`extends`: how far a kernel moves the latest end; `idle`: nothing running before it started. A kernel ending
    inside an earlier one extends nothing; overlaps are not counted twice."""
    table = timeline.account(LAYER)
    assert table["gemm qkv"] == dict(count=1, dur_us=5.0, extends_us=4.0, idle_us=0.0)
    assert table["attention_kernel"]["extends_us"] == 2.0
    assert table["layer_norm_kernel"] == dict(count=2, dur_us=3.5, extends_us=3.0, idle_us=0.0)
    assert table["gemm wi"] == dict(count=1, dur_us=3.0, extends_us=3.0, idle_us=2.0)
    inside = timeline.account([k("gemm", 0, 10), k("layer_norm", 2, 3)])
    assert inside["layer_norm_kernel"]["extends_us"] == 0.0
    span = LAYER[-1]["end"] - LAYER[0]["start"]
    assert sum(r["extends_us"] + r["idle_us"] for r in table.values()) == span


def test_kernel_events_are_read_from_a_chrome_trace_in_start_order(tmp_path):
    trace = {"traceEvents": [
        {"ph": "X", "cat": "kernel", "name": "_gemm_kernel", "ts": 10.0, "dur": 4.0, "args": {"grid": [1, 64, 1]}},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 1.0, "dur": 3.0},
        {"ph": "X", "cat": "kernel", "name": "_layer_norm_kernel", "ts": 2.5, "dur": 1.5, "args": {}}]}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace))
    got = timeline.kernels(str(path))
    assert [(e["name"], e["start"], e["end"], e["grid"]) for e in got] == [
        ("_layer_norm_kernel", 2.5, 4.0, ()), ("_gemm_kernel", 10.0, 14.0, (1, 64, 1))]
