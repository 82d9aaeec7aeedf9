"""`laya-pool compare-workers` on real CPU pools: agreeing workers pass, a planted difference is found and named."""
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import SUBPROCESS_ENV, make_rows, stop_all, wait_until

ROOT = Path(__file__).resolve().parents[1]
TOOL = ["-m", "laya_pool", "compare-workers"]
ENV = SUBPROCESS_ENV


def test_agreeing_workers_pass(tiny_ckpt, tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, *TOOL, "--model", str(tiny_ckpt), "--devices", "cpu",
                           "--report", str(report)], capture_output=True, text=True, timeout=600, env=ENV)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads(report.read_text())
    assert len(data["workers"]) == 2 and not data["failures"] and len(data["cases"]) >= 13
    assert data["reference"].startswith("official SDK")
    assert all(r["max_dp"] <= data["tolerances"]["fp32"]["dp"] for r in data["results"])


def _perturbed(src: Path, dst: Path, tensor: str) -> Path:
    from safetensors.numpy import load_file, save_file
    shutil.copytree(src, dst)
    t = load_file(str(dst / "model.safetensors"))
    noise = np.random.default_rng(5).standard_normal(t[tensor].shape).astype(np.float32)
    t[tensor] = t[tensor] + 0.05 * noise
    save_file(t, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _wait(client, pred, timeout=120.0):
    from laya_pool.client.errors import PoolError

    def reached():
        st = client.status()
        return st if pred(st) else None
    return wait_until(reached, timeout, "pool did not reach the expected state", interval=0.3, ignore=(PoolError,))


def test_planted_difference_is_named(tiny_ckpt, tmp_path):
    from laya_pool.client.pool import Client
    bad = _perturbed(tiny_ckpt, tmp_path / "bad", "encoder.layers.2.mlp.Wo.weight")
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--heartbeat-ms", "300"], env=ENV, cwd=ROOT)]
    try:
        worker = [sys.executable, "-m", "laya_pool.worker.server", "--backend", be, "--device", "cpu", "--heartbeat-ms",
                  "300",
                  "--threads", "1"]
        procs.append(subprocess.Popen(worker + ["--model", str(tiny_ckpt), "--id", "good0"], env=ENV, cwd=ROOT))
        with Client(fe, timeout=3.0, retries=1) as c:
            _wait(c, lambda st: any(w["id"] == "good0" and w["state"] == "ready" for w in st["workers"]))
            procs.append(subprocess.Popen(worker + ["--model", str(bad), "--id", "bad1"], env=ENV, cwd=ROOT))
            _wait(c, lambda st: any(w["id"] == "bad1" and w["state"] == "mismatch" for w in st["workers"]))
            # ordinary traffic never reaches the mismatched worker
            res = c.forward(make_rows(2, 1))
            assert res.worker == "good0"
        report = tmp_path / "report.json"
        proc = subprocess.run([sys.executable, *TOOL, "--frontend", fe, "--model", str(tiny_ckpt),
                               "--report", str(report)], capture_output=True, text=True, timeout=600, env=ENV)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1 and report.exists(), out
        data = json.loads(report.read_text())
        assert [f for f in data["failures"] if f.startswith("worker bad1")], data["failures"]
        assert not [f for f in data["failures"] if f.startswith("worker good0")], data["failures"]
        assert "first diverging tap: encoder.2 " in out, out
    finally:
        stop_all(procs)


@pytest.mark.gpu
def test_gpu_pool_workers_agree_in_every_mode(tiny_ckpt, tmp_path):
    report = tmp_path / "report.json"
    proc = subprocess.run([sys.executable, *TOOL, "--model", str(tiny_ckpt), "--devices", "cuda:0",
                           "--report", str(report)], capture_output=True, text=True, timeout=900, env=ENV)
    print(proc.stdout[-3000:])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    modes = {(r["worker"], r["mode"]) for r in json.loads(report.read_text())["results"]}
    assert len(modes) == 6


def test_pool_pinned_to_its_model_keeps_a_stray_worker_out(tiny_ckpt, tmp_path):
    """`laya-pool up` pins the broker to its checkpoint's fingerprint: a worker of another model that
    registers while no right worker is ready cannot redefine what the pool serves."""
    from laya_pool.client.card import directory_fingerprint
    from laya_pool.client.pool import Client
    stray = _perturbed(tiny_ckpt, tmp_path / "stray", "scorer.1.weight")
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    procs = [subprocess.Popen([sys.executable, "-m", "laya_pool", "broker", "--frontend", fe, "--backend", be,
                               "--heartbeat-ms", "300", "--fingerprint", directory_fingerprint(tiny_ckpt)],
                              env=ENV, cwd=ROOT)]
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "laya_pool.worker.server", "--backend", be, "--device",
                                       "cpu",
                                       "--heartbeat-ms", "300", "--threads", "1", "--model", str(stray),
                                       "--id", "stray"], env=ENV, cwd=ROOT))
        with Client(fe, timeout=3.0, retries=1) as c:
            st = _wait(c, lambda st: any(w["id"] == "stray" for w in st["workers"]))
            assert [w["state"] for w in st["workers"]] == ["mismatch"]
            assert st["broker"]["fingerprint"] == directory_fingerprint(tiny_ckpt)
    finally:
        stop_all(procs)
