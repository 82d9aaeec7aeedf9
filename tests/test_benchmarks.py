"""benchmarks/ as a user runs it from the checkout: each is listed with its command, starts, and writes its results.

The GPU ones are run on a CUDA host (their figures are the performance document's); here each shows its help (its
imports and flags load), and the ones that run on a CPU pool run there.
"""
from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in ("__init__", "common"))


def _run(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True,
                          text=True, timeout=timeout)


def test_the_readme_lists_every_benchmark_with_its_command():
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    rows = {m[0]: m[1] for m in re.findall(r"^\| `(\w+)\.py` \| .+ \| `python -m benchmarks\.(\w+)[^`]*` \|$",
                                            readme, re.M)}
    assert sorted(rows) == BENCHMARKS and all(k == v for k, v in rows.items()), rows
    assert len(BENCHMARKS) >= 10


def test_every_benchmark_shows_its_help_with_out():
    procs = {name: subprocess.Popen([sys.executable, "-m", f"benchmarks.{name}", "--help"], cwd=ROOT,
                                    env=SUBPROCESS_ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name in BENCHMARKS}
    bad = []
    for name, p in procs.items():
        out, err = p.communicate(timeout=120)
        if p.returncode != 0 or "--out OUT" not in out or f"python -m benchmarks.{name}" not in out:
            bad.append(f"{name}: exit {p.returncode}\n{out[-500:]}{err[-2000:]}")
    assert not bad, "\n\n".join(bad)


@pytest.mark.timeout(240)
def test_ready_times_a_pool_up_to_ready_and_writes_it(tiny_ckpt, tmp_path):
    r = _run("benchmarks.ready", "--model", str(tiny_ckpt), "--devices", "cpu", "--runs", "1", "--out",
             str(tmp_path), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "ready.json").read_text())
    (run,) = got["result"]["runs"]
    assert 0 < run["seconds"] < 180 and run["workers"] == 1 and "date" in got["machine"]
    assert any("started in" in line for line in run["log"]), run["log"]
    assert f"ready {run['seconds']:.1f} s after `up`" in r.stdout


def test_client_speed_writes_a_row_per_shape(tiny_ckpt, tmp_path):
    r = _run("benchmarks.client_speed", "--model", str(tiny_ckpt), "--calls", "8", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads((tmp_path / "client_speed.json").read_text())["result"]
    from laya_pool.tools.bench import SHAPES
    assert [row["shape"] for row in rows] == [f"{n}x{t}" for n, t in SHAPES]
    assert all(0 < row[s]["p50"] <= row[s]["p95"] for row in rows for s in ("encode", "pack", "decode"))


def test_client_speed_through_a_stub_times_both_clients_predict_forward_and_ping(tiny_ckpt, tmp_path):
    r = _run("benchmarks.client_speed", "--model", str(tiny_ckpt), "--calls", "20", "--stub", "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "client_speed.json").read_text())["result"]
    stub = got["through_stub"]
    assert set(stub) == {"encode + decode", "predict", "forward", "ping", "AsyncClient.predict",
                         "predict, reply replayed", "encode + wire + decode"}
    assert len(got["stages"]) >= 4
    assert all(0 < v["p50"] <= v["p95"] for v in stub.values())
    for kind in ("predict", "AsyncClient.predict"):         # a pool call on top of the local work
        assert stub[kind]["p50"] > stub["encode + decode"]["p50"]
    # what a replayed predict runs is its stages and more, and never the wire's wait
    assert stub["encode + wire + decode"]["p50"] < stub["predict, reply replayed"]["p50"] < stub["predict"]["p50"]


def test_overhead_splits_a_pooled_forward_into_its_parts(tiny_ckpt, tmp_path):
    r = _run("benchmarks.overhead", "--model", str(tiny_ckpt), "--samples", "20", "--warmup", "5", "--burst", "5",
             "--out", str(tmp_path), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "overhead.json").read_text())["result"]
    # every kind timed as often as asked, and each part of a pooled forward read from its reply's stamps
    for kind in ("ping", "forward", "forward via broker", "in-process", "up", "up: to the broker", "queue",
                 "worker", "launch", "device wait", "down", "down: to the client"):
        assert got[kind]["n"] == 20 and 0 <= got[kind]["p50"] <= got[kind]["p95"], (kind, got[kind])
    assert got["up"]["p50"] > 0 and got["down"]["p50"] > 0
    assert got["added"] == round(got["forward"]["p50"] - got["in-process"]["p50"], 4)
    assert got["config"]["worker"] == "cpu" and got["config"]["burst"] == 5 and len(got["steps"]) == 6
    assert f"{got['added']:8.3f}" in r.stdout


def test_after_wait_times_encode_and_decode_after_each_kind_of_wait(tiny_ckpt, tmp_path):
    r = _run("benchmarks.after_wait", "--model", str(tiny_ckpt), "--device", "cpu", "--calls", "5", "--rounds", "2",
             "--out", str(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "after_wait.json").read_text())["result"]
    assert got["device"] == "cpu" and list(got["kinds"]) == ["none", "sleep", "spin"]     # the CUDA kinds need CUDA
    assert all(0 < k[step]["p50"] <= k[step]["p95"] for k in got["kinds"].values() for step in ("encode", "decode"))
    assert all(f"\n{kind} " in r.stdout for kind in got["kinds"])
    r = _run("benchmarks.after_wait", "--model", str(tiny_ckpt), "--device", "cpu", "--rounds", "1")
    assert r.returncode == 2 and "--rounds must be at least 2" in r.stderr


@pytest.mark.timeout(400)
def test_http_measures_the_gateway_and_laya_serve_and_writes_them(tiny_ckpt, tmp_path):
    pytest.importorskip("laya.serve")
    pytest.importorskip("uvicorn")
    r = _run("benchmarks.http", "--model", str(tiny_ckpt), "--devices", "cpu", "--clients", "1,3", "--seconds", "1",
             "--warmup", "2", "--procs", "2", "--out", str(tmp_path), timeout=380)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "http.json").read_text())["result"]
    for n in ("1", "3"):
        for kind in ("gateway", "laya-serve"):
            row = got["rows"][n][kind]
            assert row["clients"] == int(n) and row["decisions_per_s"] > 0 and row["not_200"] == {}, row["refusals"]
            assert 0 < row["p50_ms"] <= row["p95_ms"] and row["requests"] >= row["decisions_per_s"]
            assert 0 < row["inference_p50_ms"] <= row["p50_ms"]      # a part of each request's time, read per answer
        assert got["rows"][n]["gateway_over_laya_serve"] == round(
            got["rows"][n]["gateway"]["decisions_per_s"] / got["rows"][n]["laya-serve"]["decisions_per_s"], 2)
    assert got["gateway_minus_client_p50_ms"] == round(got["rows"]["1"]["gateway"]["p50_ms"]
                                                       - got["client_predict_p50_ms"], 3)
    assert "at 1 client: gateway p50 - Client.predict p50 = " in r.stdout
    assert all(got["rows"][n][k]["server_cpu_ms_per_request"] > 0 for n in ("1", "3")
               for k in ("gateway", "laya-serve"))


@pytest.mark.timeout(200)
def test_http_with_a_stub_measures_the_gateway_alone(tiny_ckpt, tmp_path):
    """The stub worker serves the checkpoint's card, so the gateway's client encodes and decodes real requests."""
    pytest.importorskip("uvicorn")
    r = _run("benchmarks.http", "--model", str(tiny_ckpt), "--stub", "--clients", "4", "--seconds", "1",
             "--warmup", "2", "--procs", "1", "--gateway-processes", "2", "--out", str(tmp_path), timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads((tmp_path / "http.json").read_text())["result"]
    assert list(got["rows"]["4"]) == ["gateway"] and got["gateway_processes"] == 2
    row = got["rows"]["4"]["gateway"]
    assert row["not_200"] == {} and row["refusals"] == [], row["refusals"]
    assert row["decisions_per_s"] > 0 and row["server_cpu_ms_per_request"] > 0
    assert 0 < row["inference_p50_ms"] <= row["p50_ms"]


@pytest.mark.timeout(200)
def test_http_keeps_what_an_answer_other_than_200_said(tiny_ckpt, tmp_path):
    """A gateway that takes one request at a time answers the others 503 at once: counted, and their bodies kept."""
    pytest.importorskip("uvicorn")
    from laya_pool.gateway.limits import BUSY
    r = _run("benchmarks.http", "--model", str(tiny_ckpt), "--stub", "--clients", "4", "--seconds", "1",
             "--warmup", "1", "--procs", "1", "--gateway-args", "--max-concurrent 1", "--out", str(tmp_path),
             timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    row = json.loads((tmp_path / "http.json").read_text())["result"]["rows"]["4"]["gateway"]
    assert row["not_200"].get("503", 0) >= len(row["refusals"]) > 0
    assert all(x[:4] == "503 " and json.loads(x[4:]) == {"detail": BUSY} for x in row["refusals"]), row["refusals"]
    assert "gateway    answered 503 " in r.stdout


def test_a_benchmark_takes_no_abbreviated_flag(tiny_ckpt):
    r = _run("benchmarks.client_speed", "--model", str(tiny_ckpt), "--call", "8")
    assert r.returncode == 2 and "unrecognized arguments: --call 8" in r.stderr, r.stderr


def test_every_script_or_benchmark_path_the_product_names_exists():
    """A path under scripts/ or benchmarks/ named in the package, the tests, the benchmarks, the README, the Makefile
    or the documents (their records of past decisions aside) is there."""
    files = [*(ROOT / "laya_pool").rglob("*.py"), *(ROOT / "tests").glob("*.py"), *(ROOT / "benchmarks").glob("*"),
             ROOT / "README.md", ROOT / "Makefile", *(p for p in (ROOT / "docs").glob("*.md") if p.name != "PERF.md")]
    missing = []
    for f in files:
        for m in re.finditer(r"(?<![\w/])(scripts|benchmarks)/[\w./-]*\w", f.read_text(errors="replace")):
            if not (ROOT / m.group(0)).exists():
                missing.append(f"{f.relative_to(ROOT)}: {m.group(0)}")
    assert not missing, missing


@pytest.mark.timeout(240)
def test_scale_runs_a_broker_under_stub_hosts_and_writes_each_phase(tmp_path):
    """A small scale run (2 hosts x 2 stub workers over tcp + CURVE): every phase answered without an error, and a
    call sent to the workers themselves costs the broker less than one it routes."""
    r = _run("benchmarks.scale", "--hosts", "2", "--workers", "2", "--procs", "1", "--window", "8", "--seconds", "1",
             "--out", str(tmp_path), timeout=200)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {row["phase"]: row for row in json.loads((tmp_path / "scale.json").read_text())["result"]["results"]}
    assert sorted(got) == ["direct", "idle", "routed", "routes"]
    assert all(got[p]["calls_per_s"] > 0 and got[p]["errors"] == 0 for p in ("routed", "direct", "routes"))
    assert got["idle"]["calls_per_s"] == 0 and got["direct"]["broker_messages_per_s"] == 0
    assert got["direct"]["cpu_cores"]["broker"] < got["routed"]["cpu_cores"]["broker"]
    assert "broker_ceiling_per_s" in got["routed"] and "broker_ceiling_per_s" not in got["direct"]
    assert '{"workers": 4, "routes": 4}' in r.stdout
