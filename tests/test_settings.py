"""protocol/settings.py: every environment variable declared once, read only through it, documented from it."""
from __future__ import annotations

import argparse
import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, SUBPROCESS_ENV

from laya_pool.protocol import contract, settings

PACKAGE = ROOT / "laya_pool"
HOME = PACKAGE / "protocol" / "settings.py"       # the one module that reads the environment itself
DOC = ROOT / "docs" / "operations.md"


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os") or (isinstance(node, ast.Name) and node.id == "environ")


def _literal(args: list[ast.expr]) -> str | None:
    return args[0].value if args and isinstance(args[0], ast.Constant) and isinstance(args[0].value, str) else None


def _reads(tree: ast.AST) -> list[tuple[int, str | None, bool]]:
    """Every read of the environment in `tree`: (line, the name when it is a literal, whether it is direct, i.e. not
    through settings). os.environ[...], os.environ.get, environ.get, os.getenv, `in os.environ`, and settings.get /
    settings.raw / settings.setting; writes (os.environ[X] = ..., setdefault, a copy for a child) are not reads."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            s = node.slice
            out.append((node.lineno, s.value if isinstance(s, ast.Constant) else None, True))
        elif isinstance(node, ast.Compare) and any(_is_environ(c) for c in node.comparators):
            left = node.left
            out.append((node.lineno, left.value if isinstance(left, ast.Constant) else None, True))
        elif isinstance(node, ast.Call):
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "get" and _is_environ(f.value):
                out.append((node.lineno, _literal(node.args), True))
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv" and isinstance(f.value, ast.Name)
                  and f.value.id == "os") or (isinstance(f, ast.Name) and f.id == "getenv"):
                out.append((node.lineno, _literal(node.args), True))
            elif (isinstance(f, ast.Attribute) and f.attr in ("get", "raw", "setting")
                  and isinstance(f.value, ast.Name) and f.value.id == "settings"):
                out.append((node.lineno, _literal(node.args), False))
    return out


def scan(root: Path, home: Path = HOME) -> list[str]:
    """What is wrong with the environment reads under `root`: a literal name nothing declares, or a read of the
    environment that does not go through `home`."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, name, direct in _reads(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.relative_to(root)}:{line}"
            if name is not None and name not in settings.DECLARED:
                found.append(f"{where}: ${name} is not declared in protocol/settings.py")
            elif direct and path != home:
                found.append(f"{where}: reads the environment itself (read it through protocol/settings.py)")
    return found


def test_every_read_of_the_environment_is_declared_and_goes_through_settings():
    assert scan(PACKAGE) == []


def _unread() -> list[str]:
    """Declared names no code names: `up`'s variables are named from their options (checked by
    test_every_up_option_reads_its_declared_variable); a test-only one may be read by the GPU tests alone."""
    def literals(paths) -> set[str]:
        return {n.value for p in paths for n in ast.walk(ast.parse(p.read_text(encoding="utf-8")))
                if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    code = literals(p for p in PACKAGE.rglob("*.py") if p != HOME)
    tests = literals((ROOT / "tests").glob("test_*_gpu.py"))
    return [s.name for s in settings.DECLARED.values() if s.section != settings.POOL
            and s.name not in code and not (s.section == settings.FAULTS and s.name in tests)]


def test_every_declaration_is_read_somewhere(monkeypatch):
    """No stale row (a switch removed, a tool moved away, and its declaration left behind)."""
    assert _unread() == []
    stale = settings.Setting("LAYA_GONE", settings.BOOL, False, settings.KERNELS, "worker", "Nothing reads it.")
    monkeypatch.setitem(settings.DECLARED, "LAYA_GONE", stale)
    assert _unread() == ["LAYA_GONE"]


def test_the_scan_finds_an_undeclared_or_direct_read(tmp_path):
    """The check above can fail: each form of read is found, and a write is not taken for one."""
    (tmp_path / "planted.py").write_text(
        "import os\nfrom os import environ, getenv\nfrom laya_pool.protocol import settings\n"
        "a = os.environ.get('LAYA_PLANTED_GET')\n"
        "b = os.environ['LAYA_PLANTED_ITEM']\n"
        "c = os.getenv('LAYA_PLANTED_GETENV')\n"
        "d = environ.get('LAYA_PLANTED_ENVIRON')\n"
        "e = getenv('LAYA_PLANTED_BARE')\n"
        "f = 'LAYA_PLANTED_IN' in os.environ\n"
        "g = settings.get('LAYA_PLANTED_SETTING')\n"
        "h = os.environ.get('LAYA_PDL')\n"                   # declared, but read around the module
        "os.environ['LAYA_PLANTED_WRITE'] = '1'\n"           # writes are not reads
        "child = dict(os.environ, PYTHONPATH='x')\n"
        "ok = settings.get('LAYA_PDL')\n")
    found = scan(tmp_path)
    for name in ("GET", "ITEM", "GETENV", "ENVIRON", "BARE", "IN", "SETTING"):
        assert sum(f"$LAYA_PLANTED_{name} is not declared" in f for f in found) == 1, (name, found)
    assert [f for f in found if "planted.py:11:" in f] == ["planted.py:11: reads the environment itself (read it "
                                                           "through protocol/settings.py)"]
    assert len(found) == 8 and not any("WRITE" in f or ":13:" in f or ":14:" in f for f in found), found


def test_the_table_in_operations_md_is_the_modules():
    doc = DOC.read_text(encoding="utf-8")
    assert settings.splice(doc) == doc, "docs/operations.md: run python -m laya_pool.protocol.settings " \
                                        "docs/operations.md"
    for name in settings.DECLARED:
        assert f"| `{name}` |" in doc


def test_a_drifted_table_is_caught():
    """The check above can fail: a row edited by hand, or a row the document lacks, makes it differ."""
    doc = DOC.read_text(encoding="utf-8")
    edited = doc.replace("| `LAYA_PDL` | bool | `1` |", "| `LAYA_PDL` | bool | `0` |")
    row = doc[doc.index("| `LAYA_TMA` |"):].split("\n", 1)[0] + "\n"
    stale = doc.replace(row, "")
    for drifted in (edited, stale):
        assert drifted != doc and settings.splice(drifted) != drifted and settings.splice(drifted) == doc
    with pytest.raises(ValueError, match="markers"):
        settings.splice("no markers here")


@pytest.mark.parametrize("name,raw,want", [
    ("LAYA_PDL", None, True), ("LAYA_PDL", "", True), ("LAYA_PDL", "0", False), ("LAYA_PDL", "Off", False),
    ("LAYA_PDL", "yes", True), ("LAYA_K_CHUNKS", None, False), ("LAYA_K_CHUNKS", "1", True),
    ("LAYA_MERGE_WASTE", "-1", -1), ("LAYA_MERGE_WASTE", None, 512), ("LAYA_GIL_SWITCH_MS", "0.25", 0.25),
    ("LAYA_GIL_SWITCH_MS", None, None), ("LAYA_ATTN", "SDPA", "sdpa"), ("LAYA_ATTN", None, "triton"),
    ("LAYA_DIRECT_ENDPOINT", "ipc:///run/{id}", "ipc:///run/{id}"),
])
def test_values_are_typed_and_unset_or_empty_is_the_default(name, raw, want):
    env = {} if raw is None else {name: raw}
    assert settings.get(name, env) == want
    assert type(settings.get(name, env)) is type(want)


@pytest.mark.parametrize("name,raw,why", [
    ("LAYA_PDL", "2", "not a boolean (1/0, true/false, yes/no, on/off)"),
    ("LAYA_MERGE_WASTE", "lots", "not an integer"),
    ("LAYA_GIL_SWITCH_MS", "fast", "not a number"), ("LAYA_ATTN", "flash", "not one of triton, sdpa"),
])
def test_a_bad_value_names_the_variable_and_the_value(name, raw, why):
    with pytest.raises(ValueError) as e:
        settings.get(name, {name: raw})
    assert str(e.value) == f"${name}={raw!r}: {why}"


def test_only_declared_names_can_be_read():
    for read in (settings.get, settings.raw, lambda name: settings.snapshot((name,))):
        with pytest.raises(ValueError, match=r"\$LAYA_NOT_A_SETTING is not declared"):
            read("LAYA_NOT_A_SETTING")


def test_reads_see_what_os_environ_holds_now(monkeypatch):
    monkeypatch.delenv("LAYA_DIRECT_ENDPOINT", raising=False)
    assert settings.get("LAYA_DIRECT_ENDPOINT") == "tcp://127.0.0.1:*" and settings.raw("LAYA_DIRECT_ENDPOINT") is None
    monkeypatch.setenv("LAYA_DIRECT_ENDPOINT", "ümlaut 1")
    assert settings.get("LAYA_DIRECT_ENDPOINT") == os.environ["LAYA_DIRECT_ENDPOINT"] == "ümlaut 1"
    monkeypatch.setenv("LAYA_PDL", "1")
    assert settings.get("LAYA_PDL") is True
    os.environ["LAYA_PDL"] = "0"       # set the usual way between two reads, as a benchmark does
    assert settings.get("LAYA_PDL") is False
    del os.environ["LAYA_PDL"]
    assert settings.get("LAYA_PDL") is True


def test_a_hot_read_parses_each_value_once(monkeypatch):
    """The kernels ask on every launch: a value is parsed when it changes, not at each read."""
    parsed = []
    parse = settings.Setting.parse
    monkeypatch.setattr(settings.Setting, "parse", lambda self, raw: parsed.append(raw) or parse(self, raw))
    monkeypatch.setenv("LAYA_LAUNCH_CACHE", "0")
    assert all(settings.get("LAYA_LAUNCH_CACHE") is False for _ in range(1000))
    monkeypatch.setenv("LAYA_LAUNCH_CACHE", "1")
    assert all(settings.get("LAYA_LAUNCH_CACHE") is True for _ in range(1000))
    if os.name == "posix":
        assert parsed == ["0", "1"]


def test_every_up_and_workers_option_reads_its_declared_variable(monkeypatch):
    """The options of `laya-pool up` and `laya-pool workers` and their LAYA_POOL_* declarations agree: name, type,
    choices and default."""
    from laya_pool.broker import cli
    for name in settings.DECLARED:
        monkeypatch.delenv(name, raising=False)
    sub = next(a for a in cli.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    options = [a for command in ("up", "workers") for a in sub.choices[command]._actions
               if a.option_strings and a.dest not in ("help", "log_level", "log_format")]
    kinds = {"int": settings.INT, "float": settings.FLOAT}
    for a in options:
        s = settings.setting(cli.env_name(a))
        if isinstance(a, argparse._StoreTrueAction):
            kind = settings.BOOL
        elif a.choices:
            kind = settings.CHOICE
        else:
            kind = kinds.get(getattr(a.type, "__name__", ""), settings.STR)
        assert (s.kind if s.kind != settings.PATH else settings.STR, s.choices, s.default) == (
            kind, tuple(a.choices or ()), a.default), s.name
        assert s.meaning.startswith(f"`{a.option_strings[0]}`: "), s.name
    pool = {s.name for s in settings.DECLARED.values() if s.section == settings.POOL}
    assert pool == {cli.env_name(a) for a in options}


def test_names_other_modules_hold_are_declared():
    from laya_pool.broker import cli, operator
    from laya_pool.protocol import logs
    for name in (contract.FRONTEND_ENV, logs.LEVEL_ENV, logs.FORMAT_ENV, operator.SECRET_ENV, cli.ENV_PREFIX + "KEYS"):
        assert name in settings.DECLARED


def test_undeclared_names_and_their_nearest():
    env = {"LAYA_LANSE": "on", "LAYA_PREFETCH": "0", "LAYA_API_KEY": "sdk", "LAYA_PDL": "1", "HOME": "/root"}
    assert settings.undeclared(env) == [("LAYA_LANSE", "LAYA_LANES"), ("LAYA_PREFETCH", None)]


def test_the_warning_comes_once_a_process(monkeypatch, caplog):
    monkeypatch.setattr(settings, "_WARNED", [])
    monkeypatch.setenv("LAYA_POOL_FRONTED", "tcp://127.0.0.1:1")
    log = __import__("logging").getLogger("laya-pool.test")
    with caplog.at_level("WARNING"):
        settings.warn_undeclared(log)
        settings.warn_undeclared(log)
    lines = [r.getMessage() for r in caplog.records if "LAYA_POOL_FRONTED" in r.getMessage()]
    assert lines == ["$LAYA_POOL_FRONTED is set but laya-pool has no such setting (did you mean LAYA_POOL_FRONTEND?); "
                     "it changes nothing (docs/operations.md lists them)"]


@pytest.mark.parametrize("argv", [
    ["-m", "laya_pool.worker.server", "--model", "m", "--backend", "ipc:///nowhere", "--id", "0", "--credit", "0"],
    ["-m", "laya_pool.broker.cli", "up", "--model", "/nonexistent/checkpoint"],
])
def test_a_misspelt_variable_gets_one_warning_line_naming_it(argv):
    """A worker and `laya-pool up`, each stopped by a usage error right after their start: the typo is named once,
    with the variable it was meant to be."""
    env = dict(SUBPROCESS_ENV, LAYA_LANSE="off", LAYA_API_KEY="the SDK's")
    r = subprocess.run([sys.executable, *argv], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == contract.EXIT_USAGE, r.stderr
    lines = [line for line in r.stderr.splitlines() if "LAYA_LANSE" in line]
    assert len(lines) == 1 and "did you mean LAYA_LANES?" in lines[0], r.stderr
    assert "LAYA_API_KEY" not in r.stderr


def test_up_hands_its_children_no_undeclared_variable(monkeypatch):
    """`up` warned once for the pool; its broker and workers, which read none of them, do not repeat it."""
    from laya_pool.broker.supervisor import Supervisor, SupervisorConfig
    monkeypatch.setenv("LAYA_LANSE", "off")
    monkeypatch.setenv("LAYA_API_KEY", "the SDK's")
    monkeypatch.setenv("LAYA_LANES", "off")
    sup = Supervisor(SupervisorConfig(model="m", devices=["cpu", "cpu"], backend="ipc:///nowhere"))
    for child in (sup.broker, *sup.workers.values()):
        assert "LAYA_LANSE" not in child.env and child.env["LAYA_LANES"] == "off", child.name
        assert child.env["LAYA_API_KEY"] == "the SDK's"
