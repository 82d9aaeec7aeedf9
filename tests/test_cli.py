"""`laya-pool` as a user meets it: one line and a documented exit code for every mistake, never a traceback.

Each case runs `python -m laya_pool ...` as a subprocess (all at once, so the file takes about a second
of wall time), and the parser's own rules (help text and environment variable for every option) are
checked in-process.
"""
from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, free_port

from laya_pool.broker import cli

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.timeout(120)


def _spawn(*args: str, env: dict | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "laya_pool", *args], cwd=ROOT, text=True,
                            env={**SUBPROCESS_ENV, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _cases(tmp: Path) -> list[tuple[list[str], dict, int, str]]:
    """(argv, extra environment, exit code, what the one line must say)."""
    (tmp / "empty").mkdir()
    (tmp / "bad.json").write_text("{not json")
    dead = f"tcp://127.0.0.1:{free_port()}"
    return [
        (["predict", "--state", "x", "--questions", f"@{tmp}/missing.json"], {}, 2, "--questions: cannot read"),
        (["predict", "--state", "x", "--questions", f"@{tmp}/bad.json"], {}, 2, "--questions: not JSON"),
        (["predict", "--questions", "{}"], {}, 2, "give --state TEXT or --state-json"),
        (["status", "--frontend", "localhost:5555"], {}, 2, "is not an endpoint"),
        (["status", "--frontend", "tcp://127.0.0.1"], {}, 2, "give a port"),
        (["--log-level", "loud", "status"], {}, 2, "unknown log level 'loud'"),
        (["status", "--log-level", "loud"], {}, 2, "unknown log level 'loud'"),
        (["status", "--frontend", dead], {"LAYA_POOL_LOG": "loud"}, 2, "$LAYA_POOL_LOG: unknown log level"),
        (["status", "--log-format", "xml"], {}, 2, "--log-format"),
        (["up", "--model", f"{tmp}/nowhere"], {}, 2, "--model: "),
        (["up", "--model", f"{tmp}/nowhere"], {}, 2, "`laya-pool make-checkpoint --out DIR` writes a tiny one"),
        # a flag is spelled whole: --worker is not taken for --workers-per-device
        (["up", "--model", f"{tmp}/empty", "--worker", "2"], {}, 2, "unrecognized arguments: --worker 2"),
        (["status", "--front", "tcp://127.0.0.1:5555"], {}, 2, "unrecognized arguments: --front"),
        (["up", "--model", f"{tmp}/empty"], {}, 2, "is not a checkpoint: missing rl_agent_config.json"),
        (["up", "--model", f"{tmp}/empty", "--devices", "gpu0"], {}, 2, "--devices: 'gpu0' is not cpu or cuda:N"),
        (["up", "--model", f"{tmp}/empty", "--workers-per-device", "0"], {}, 2, "must be greater than 0"),
        (["up"], {}, 2, "the following arguments are required: --model"),
        (["up", "--model", f"{tmp}/empty"], {"LAYA_POOL_WORKERS_PER_DEVICE": "two"}, 2,
         "$LAYA_POOL_WORKERS_PER_DEVICE: 'two' is not an integer"),
        (["up", "--model", f"{tmp}/empty", "--http", "0.0.0.0:9464"], {}, 2, "refusing to serve --http"),
        (["up", "--model", f"{tmp}/empty", "--api", "0.0.0.0:9465"], {}, 2, "refusing to serve the API on 0.0.0.0"),
        (["up", "--model", f"{tmp}/empty", "--api", "9465", "--api-key-file", f"{tmp}/nokey"], {}, 2,
         "--api-key-file: cannot read"),
        (["api", "--listen", "0.0.0.0:9466"], {}, 2, "refusing to serve the API on 0.0.0.0: not a loopback address"),
        (["api", "--listen", "host:port"], {}, 2, "--listen 'host:port': expected PORT or HOST:PORT"),
        (["api", "--api-key", "k", "--api-key-file", f"{tmp}/bad.json"], {}, 2, "not both"),
        (["api", "--listen", "0.0.0.0:9466"], {"LAYA_POOL_API_KEY": "  "}, 2, "the API key is empty"),
        (["api", "--max-concurrent", "0"], {}, 2, "must be greater than 0"),
        (["api", "--frontend", "localhost:5555"], {}, 2, "is not an endpoint"),
        (["reload", "--model", f"{tmp}/nowhere"], {}, 2, "--model: "),
        (["drain", "0", "--keys", f"{tmp}/nokeys"], {}, 2, "--keys: "),
        (["frobnicate"], {}, 2, "invalid choice: 'frobnicate'"),
        # after the subcommand too, and at debug level: still one line for the user
        (["status", "--frontend", dead, "--timeout", "0.2", "--retries", "0", "--log-level", "debug"], {}, 3,
         "nothing answered at this endpoint"),
    ]


def test_user_errors_are_one_line_with_their_exit_code(tmp_path):
    cases = _cases(tmp_path)
    procs = [(argv, code, want, _spawn(*argv, env=env)) for argv, env, code, want in cases]
    bad = []
    for argv, code, want, p in procs:
        out, err = p.communicate(timeout=60)
        lines = [ln for ln in err.splitlines() if ln.strip() and " DEBUG " not in ln]
        if (p.returncode != code or "Traceback" in err or want not in err or len(lines) != 1
                or not lines[0].startswith("laya-pool")):
            bad.append(f"{argv}: exit {p.returncode} (want {code}), stderr:\n{err}")
    assert not bad, "\n\n".join(bad)


def test_api_on_a_taken_port_exits_78():
    import socket
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        p = _spawn("api", "--listen", str(held.getsockname()[1]))
        out, err = p.communicate(timeout=60)
    assert p.returncode == 78 and "cannot listen on 127.0.0.1:" in err and "Traceback" not in err, err


def test_the_check_catches_a_traceback():
    """The harness above fails on what it must catch: a command that dies of an exception."""
    p = subprocess.run([sys.executable, "-c", "raise SystemExit(__import__('json').loads('{'))"],
                       capture_output=True, text=True, env=SUBPROCESS_ENV)
    assert p.returncode == 1 and "Traceback" in p.stderr


def test_version_and_help_list_the_exit_codes():
    p = _spawn("--version")
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0 and out.startswith("laya-pool "), out + err
    p = _spawn("--help")
    out, _ = p.communicate(timeout=60)
    for code, _text in cli.EXIT_CODES:
        assert f"\n  {code:>3}  " in out, out


def test_help_lists_the_tools_however_it_is_asked_for():
    from laya_pool.__main__ import TOOLS
    asks = [("--help",), ("-h",), ("--log-level", "info", "--help"), ("--log-format", "json", "-h"), ()]
    procs = [(ask, _spawn(*ask)) for ask in asks]
    for ask, p in procs:
        out, err = p.communicate(timeout=60)
        assert p.returncode == (0 if ask else 2), (ask, err)
        assert "tools (laya-pool TOOL --help):" in out, (ask, out)
        missing = [t for t in TOOLS if not re.search(rf"^  {re.escape(t)} +\S", out, re.M)]
        assert not missing, (ask, missing)


def test_no_parser_of_ours_takes_an_abbreviated_flag():
    """Every ArgumentParser built in the package and in benchmarks/ says allow_abbrev=False, and the CLI's parsers
    (the subcommands' too) have it."""
    import argparse
    import ast
    lax = []
    for path in sorted([*(ROOT / "laya_pool").rglob("*.py"), *(ROOT / "benchmarks").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "ArgumentParser"):
                flag = next((k.value for k in node.keywords if k.arg == "allow_abbrev"), None)
                if not (isinstance(flag, ast.Constant) and flag.value is False):
                    lax.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not lax, f"ArgumentParser without allow_abbrev=False: {lax}"
    p = cli.build_parser()
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
    assert not p.allow_abbrev and not any(sp.allow_abbrev for sp in subs.choices.values())


def _options(parser) -> list:
    import argparse
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return [(name, a) for name, sp in subs.choices.items() for a in sp._actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_option_has_help_and_every_up_option_an_environment_variable():
    p = cli.build_parser()
    missing = [f"{cmd} {a.option_strings[0]}" for cmd, a in _options(p) if not (a.help or "").strip()]
    assert not missing, missing
    up = [a for cmd, a in _options(p) if cmd == "up" and a.dest not in ("log_level", "log_format")]
    assert len(up) >= 30
    assert all(f"[${cli.env_name(a)}]" in a.help for a in up)
    assert {cli.env_name(a) for a in up} >= {"LAYA_POOL_MODEL", "LAYA_POOL_DEVICES", "LAYA_POOL_FRONTEND",
                                             "LAYA_POOL_HTTP", "LAYA_POOL_WARMUP_SHAPES", "LAYA_POOL_QUEUE_SIZE"}


def test_environment_gives_defaults_and_flags_beat_it(monkeypatch):
    monkeypatch.setenv("LAYA_POOL_MODEL", "/srv/m")
    monkeypatch.setenv("LAYA_POOL_DEVICES", "cuda:0,cuda:1")
    monkeypatch.setenv("LAYA_POOL_QUEUE_SIZE", "7")
    monkeypatch.setenv("LAYA_POOL_INSECURE_BACKEND", "yes")
    a = cli.build_parser().parse_args(["up"])
    assert (a.model, a.devices, a.queue_size, a.insecure_backend) == ("/srv/m", "cuda:0,cuda:1", 7, True)
    a = cli.build_parser().parse_args(["up", "--model", "/x", "--devices", "cpu", "--queue-size", "9"])
    assert (a.model, a.devices, a.queue_size) == ("/x", "cpu", 9)
    a = cli.build_parser().parse_args(["--log-level", "debug", "status"])
    assert a.log_level == "DEBUG"
    a = cli.build_parser().parse_args(["status", "--log-level", "warning"])
    assert a.log_level == "WARNING"


def test_up_hands_its_worker_options_to_every_worker(monkeypatch):
    monkeypatch.delenv("LAYA_POOL_WARMUP_MERGED", raising=False)
    monkeypatch.delenv("LAYA_POOL_MERGE_WASTE", raising=False)
    def argv(*args: str) -> list[str]:
        return cli.worker_argv(cli.build_parser().parse_args(["up", "--model", "m", *args]))

    given = argv("--merge-waste", "-1", "--warmup-merged", "1x48x4,4x256x4")
    assert given[given.index("--merge-waste") + 1] == "-1"
    assert given[given.index("--warmup-merged") + 1] == "1x48x4,4x256x4"
    # '' is a choice (no merged buckets), not an absence; not given: the worker's default
    assert argv("--warmup-merged", "")[-2:] == ["--warmup-merged", ""]
    assert "--warmup-merged" not in argv()


def test_log_format_json_is_one_object_per_line(tmp_path):
    fe, be = f"ipc://{tmp_path}/fe", f"ipc://{tmp_path}/be"
    p = _spawn("broker", "--frontend", fe, "--backend", be, "--log-format", "json",
               env={"LAYA_POOL_RUNTIME_DIR": str(tmp_path / "run")})
    try:
        from laya_pool.client.pool import Client
        with Client(fe, timeout=10, retries=1) as c:
            c.status()
    finally:
        time.sleep(0.2)
        p.send_signal(signal.SIGTERM)
        out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines, err
    records = [json.loads(ln) for ln in lines]
    assert all({"ts", "level", "logger", "process", "msg"} <= set(r) for r in records)
    assert all(r["process"] == "broker" for r in records)


def test_exit_codes_are_distinct_and_documented():
    codes = [c for c, _ in cli.EXIT_CODES]
    assert len(set(codes)) == len(codes)
    doc = (ROOT / "docs" / "operations.md").read_text()
    for code, _ in cli.EXIT_CODES:
        assert f"| {code} |" in doc, f"exit code {code} is not in docs/operations.md"
    up = [a for cmd, a in _options(cli.build_parser()) if cmd in ("up", "workers")
          and a.dest not in ("log_level", "log_format")]
    rows = {line.split(" | ")[0]: line for line in doc.splitlines() if line.startswith("| `LAYA_")}
    missing = [cli.env_name(a) for a in up if f"`{a.option_strings[0]}`" not in rows.get(f"| `{cli.env_name(a)}`", "")]
    assert not missing, f"not in docs/operations.md's table with their option: {missing}"
    for name in ("LAYA_POOL_LOG", "LAYA_POOL_LOG_FORMAT"):
        assert f"| `{name}` |" in doc


def test_the_demo_writes_its_checkpoint_where_the_readme_loads_it():
    # `make demo` in a checkout: checkpoints/tiny, which the README's `laya.load("checkpoints/tiny")` reads
    from laya_pool.tools.demo import _default_model
    assert _default_model() == ROOT / "checkpoints" / "tiny"
