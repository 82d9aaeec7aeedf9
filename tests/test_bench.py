"""`laya-pool bench`, reduced for the CPU: the protocol runs, the SDK is measured in the same run, outputs written."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import SUBPROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]


def test_quick_bench_writes_json_png_and_table(tiny_ckpt, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "laya_pool", "bench", "--model", str(tiny_ckpt), "--quick", "--warmup",
                           "1", "--samples", "3", "--device", "cpu", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=SUBPROCESS_ENV, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "bench.json").read_text())
    assert set(report["latency_ms"]) >= {"ours eager", "sdk predict"}
    for per in report["latency_ms"].values():
        for stats in per.values():
            assert stats["n"] == 2 * 3 and 0 < stats["min"] <= stats["p50"] <= stats["p95"]
    assert set(report["first_call_ms"]) == set(report["latency_ms"])
    assert (tmp_path / "bench.png").stat().st_size > 1000
    table = (tmp_path / "bench.md").read_text()
    assert "| sdk predict |" in table and proc.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
