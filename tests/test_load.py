"""scripts/load.py on a CPU pool: a worker SIGKILLed under load loses nothing; lost requests fail the run."""
import json
import subprocess
import sys
from pathlib import Path

from conftest import SUBPROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]


def _load(tiny_ckpt, tmp_path, *extra):
    out = tmp_path / "load.json"
    proc = subprocess.run([sys.executable, "scripts/load.py", "--model", str(tiny_ckpt), "--devices", "cpu",
                           "--concurrency", "6", "--procs", "2", "--seconds", "3", "--out", str(out), *extra],
                          cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=300)
    return proc, json.loads(out.read_text())


def test_killed_worker_loses_nothing(tiny_ckpt, tmp_path):
    proc, rep = _load(tiny_ckpt, tmp_path, "--workers-per-device", "2", "--kill-after", "1")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    clean, kill = rep["pool"], rep["with_kill"]
    assert clean["lost"] == 0 and clean["answered"] > 50 and clean["killed"] is None
    assert kill["lost"] == 0 and kill["answered"] > 50
    assert kill["killed"]["killed"] in {"0", "1"} and kill["killed"]["ready_again_s"] > 0
    assert "lost 0" in proc.stdout


def test_lost_requests_fail_the_run(tiny_ckpt, tmp_path):
    # Rows longer than the model's max_len are refused (final): every one of them counts as lost.
    proc, rep = _load(tiny_ckpt, tmp_path, "--tokens", "600")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert rep["pool"]["answered"] == 0 and rep["pool"]["lost"] > 0
    assert "max_len" in rep["pool"]["errors"][0] or "length" in rep["pool"]["errors"][0]
