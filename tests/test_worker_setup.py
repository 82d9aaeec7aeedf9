"""A worker's start-up: its typed config, its fault hooks, and configuration problems found before the model loads."""
from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT, SUBPROCESS_ENV

from laya_pool.protocol import contract
from laya_pool.worker.compute import MERGE_WASTE, FaultHooks
from laya_pool.worker.server import WorkerConfig, _config_problem, build_parser

CPU = [("cpu", None, None, None, ("eager", 1, 2)),
       ("cpu", None, 4, None, ("eager", 4, 8)),
       ("cpu", "graph-fixed", 1, 7, ("graph-fixed", 1, 7))]
CUDA = [("cuda:0", None, None, None, ("graph-cached", 32, 64)), ("cuda:0", "eager", 3, None, ("eager", 3, 6))]


@pytest.mark.parametrize("device,mode,max_batch,credit,want", CPU + CUDA)
def test_device_defaults(device, mode, max_batch, credit, want):
    argv = ["--model", "m", "--backend", "ipc://b", "--id", "0", "--device", device]
    for flag, v in (("--mode", mode), ("--max-batch", max_batch), ("--credit", credit)):
        if v is not None:
            argv += [flag, str(v)]
    cfg = WorkerConfig.from_args(build_parser().parse_args(argv)).for_device(device.startswith("cuda"))
    assert (cfg.mode, cfg.max_batch, cfg.credit) == want
    assert cfg.poll_us == (2000 if device.startswith("cuda") else 0)       # a CUDA data thread stays awake 2 ms
    assert cfg.usage_problem() is None


def test_parser_and_config_agree_on_every_field():
    a = build_parser().parse_args(["--model", "m", "--backend", "b", "--id", "0"])
    assert WorkerConfig.from_args(a) == WorkerConfig("m", "b", "0", log_level=a.log_level)


def test_merge_waste_from_flag_or_environment(monkeypatch):
    base = ["--model", "m", "--backend", "b", "--id", "0"]
    assert WorkerConfig.from_args(build_parser().parse_args(base)).merge_waste == MERGE_WASTE
    assert WorkerConfig.from_args(build_parser().parse_args([*base, "--merge-waste", "-1"])).merge_waste == -1
    monkeypatch.setenv("LAYA_MERGE_WASTE", "1024")          # a whole pool switched for an A/B run
    assert WorkerConfig.from_args(build_parser().parse_args(base)).merge_waste == 1024


def test_gil_switch_interval_from_flag_or_environment(monkeypatch):
    base = ["--model", "m", "--backend", "b", "--id", "0"]
    assert WorkerConfig.from_args(build_parser().parse_args(base)).gil_switch_ms is None     # Python's own
    assert WorkerConfig.from_args(build_parser().parse_args([*base, "--gil-switch-ms", "0.5"])).gil_switch_ms == 0.5
    monkeypatch.setenv("LAYA_GIL_SWITCH_MS", "0.25")        # a whole pool switched for an A/B run
    cfg = WorkerConfig.from_args(build_parser().parse_args(base)).for_device(False)
    assert cfg.gil_switch_ms == 0.25 and cfg.usage_problem() is None
    cfg = WorkerConfig.from_args(build_parser().parse_args([*base, "--gil-switch-ms", "0"])).for_device(False)
    assert "--gil-switch-ms" in cfg.usage_problem()


@pytest.mark.parametrize("extra,cuda,direct,problem", [
    ([], True, "on", None),                                       # a CUDA worker's default: clients come directly
    ([], False, "off", None),                                     # a CPU worker's (its forward holds the data thread)
    (["--keys", "{keys}"], True, "on", None),                     # with keys: a CURVE server admitting authorized/
    (["--keys", "{keys}", "--direct-endpoint", "tcp://0.0.0.0:*"], True, "on", None),   # ... so beyond loopback too
    (["--keys", "{bare}"], True, "off", None),                    # keys without authorized/: the broker only
    (["--keys", "{bare}", "--direct", "on"], True, "on", "authorized"),
    (["--direct", "on", "--direct-endpoint", "tcp://0.0.0.0:*"], False, "on", "beyond loopback"),
    (["--direct", "on", "--direct-endpoint", "tcp://127.0.0.1:7000"], False, "on", "free port"),
    (["--direct", "on", "--direct-endpoint", "ipc:///tmp/w.sock"], False, "on", "{id}"),
    (["--direct", "on", "--direct-endpoint", "ipc:///tmp/w{id}.sock"], False, "on", None),
    (["--direct", "on", "--direct-endpoint", "tcp://127.evil.example:*"], False, "on", "beyond loopback"),
])
def test_direct_socket_defaults_and_refusals(extra, cuda, direct, problem, tmp_path):
    (tmp_path / "keys" / "authorized").mkdir(parents=True)
    (tmp_path / "bare").mkdir()
    extra = [x.replace("{keys}", str(tmp_path / "keys")).replace("{bare}", str(tmp_path / "bare")) for x in extra]
    base = ["--model", "m", "--backend", "b", "--id", "0"]
    cfg = WorkerConfig.from_args(build_parser().parse_args([*base, *extra])).for_device(cuda)
    assert cfg.direct == direct
    found = cfg.usage_problem()
    assert (found is None) if problem is None else (problem in found), found


@pytest.mark.parametrize("env,want", [({}, FaultHooks(0, 0)), ({"LAYA_WORKER_HANG_ROWS": "3"}, FaultHooks(3, 0)),
                                      ({"LAYA_WORKER_FAULT_ROWS": "5", "LAYA_WORKER_HANG_ROWS": ""}, FaultHooks(0, 5))])
def test_fault_hooks_from_env(env, want):
    assert FaultHooks.from_env(env) == want


def _worker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "laya_pool.worker.server", "--device", "cpu", "--id", "x", *args],
                          env=SUBPROCESS_ENV, cwd=ROOT, capture_output=True, text=True, timeout=120)


def test_bad_keys_exit_config_before_the_model_loads(tmp_path):
    # The model is missing too: naming the keys proves they were checked first.
    r = _worker("--model", str(tmp_path / "missing"), "--backend", f"ipc://{tmp_path}/be", "--keys", str(tmp_path))
    assert r.returncode == contract.EXIT_CONFIG, r.stderr
    assert "worker.key_secret" in r.stderr and "checkpoint" not in r.stderr


def test_bad_warmup_shapes_exit_config_before_the_model_loads(tmp_path):
    r = _worker("--model", str(tmp_path / "missing"), "--backend", f"ipc://{tmp_path}/be", "--mode", "graph-cached",
                "--warmup-shapes", "4x256")
    assert r.returncode == contract.EXIT_CONFIG, r.stderr
    assert "--warmup-shapes" in r.stderr and "checkpoint" not in r.stderr


@pytest.mark.parametrize("bad", ["1x48", "1x0x4", "1x-48x4"])
def test_bad_warmup_merged_exits_config_before_the_model_loads(tmp_path, bad):
    r = _worker("--model", str(tmp_path / "missing"), "--backend", f"ipc://{tmp_path}/be", "--mode", "graph-cached",
                "--warmup-merged", bad)
    assert r.returncode == contract.EXIT_CONFIG, r.stderr
    assert "--warmup-merged" in r.stderr and "checkpoint" not in r.stderr


def test_merged_classes_default_named_or_none(monkeypatch):
    from laya_pool.worker.runtime import DEFAULT_MERGED, DEFAULT_WARMUP, parse_shapes

    def classes(*argv: str) -> tuple:
        cfg = WorkerConfig.from_args(build_parser().parse_args(["--model", "m", "--backend", "b", "--id", "0",
                                                                "--mode", "graph-cached", *argv]))
        problem, _, merged = _config_problem(cfg, parse_shapes, DEFAULT_WARMUP, DEFAULT_MERGED)
        assert problem is None
        return merged

    monkeypatch.delenv("LAYA_WARMUP_MERGED", raising=False)
    assert classes() == parse_shapes(DEFAULT_MERGED)
    assert classes("--warmup-shapes", "4x256x4") == ()           # named buckets alone, as before the flag
    assert classes("--warmup-shapes", "") == parse_shapes(DEFAULT_MERGED)     # '' shapes: the defaults, both
    assert classes("--warmup-merged", "1x48x4,4x256x4") == parse_shapes("1x48x4,4x256x4")
    assert classes("--warmup-shapes", "4x256x4", "--warmup-merged", "4x256x4") == parse_shapes("4x256x4")
    assert classes("--warmup-merged", "") == ()
    monkeypatch.setenv("LAYA_WARMUP_MERGED", "16x128x4")          # a whole pool switched for an A/B run
    assert classes() == parse_shapes("16x128x4")


def test_a_refused_variable_exits_usage_naming_it(tmp_path):
    env = dict(SUBPROCESS_ENV, LAYA_OVERLAP="maybe")
    r = subprocess.run([sys.executable, "-m", "laya_pool.worker.server", "--device", "cpu", "--id", "x", "--model",
                        str(tmp_path), "--backend", f"ipc://{tmp_path}/be"], env=env, cwd=ROOT, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == contract.EXIT_USAGE and "$LAYA_OVERLAP='maybe': not one of on, off" in r.stderr, r.stderr


def test_usage_problem_exits_usage(tmp_path):
    r = _worker("--model", str(tmp_path), "--backend", f"ipc://{tmp_path}/be", "--credit", "0")
    assert r.returncode == contract.EXIT_USAGE and "must be positive" in r.stderr


@pytest.mark.parametrize("value,device,problem", [
    ("off", "cpu", False), ("off", "cuda:0", False), ("3", "cuda:0", False),
    ("quickest", "cuda:0", True), ("-1", "cuda:0", True),
    ("", "cuda:0", False),                                     # an empty variable is unset: the default, off
    ("3", "cpu", True),                                        # a CPU forward's torch threads would share its CPU
])
def test_data_cpu_values(value, device, problem, monkeypatch):
    monkeypatch.setenv("LAYA_DATA_CPU", value)             # a whole pool switched for an A/B run
    argv = ["--model", "m", "--backend", "b", "--id", "0", "--device", device]
    found = WorkerConfig.from_args(build_parser().parse_args(argv)).for_device(device == "cuda:0").usage_problem()
    assert (found is not None and "--data-cpu" in found) if problem else found is None, found


def test_an_empty_data_cpu_flag_is_refused():
    argv = ["--model", "m", "--backend", "b", "--id", "0", "--device", "cuda:0", "--data-cpu", ""]
    found = WorkerConfig.from_args(build_parser().parse_args(argv)).for_device(True).usage_problem()
    assert found is not None and "--data-cpu" in found, found
