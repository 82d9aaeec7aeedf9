"""Imports go one way, checked for every room (as test_client_imports checks that the client stays light).

protocol imports nothing of ours; the client and the kernels import only the protocol; the worker uses the
kernels and the protocol, never the client or the broker; the broker core speaks only the protocol, and the
operator tools beside it (cli, supervisor) reach a pool through the client's public `client.pool` (and catch its
`client.errors`). The HTTP gateway is
a pool client: the client and the protocol, nothing else of ours, never torch or the SDK. No broker
module imports the worker, the kernels or torch: workers are processes started by module name. The tools
(tools/: bench, load, ...) may use every room; no room imports them.

Every room is installed as `laya_pool.<room>`, and every module must be loaded under that one name: a room
imported by its bare name (`from client.pool import ...`) would be a second copy, whose exception classes
the first copy's `except` clauses do not catch. A room imports itself relatively (`from .card import ...`).

Every import statement counts, a lazy one inside a function included (ast, not a run), so a rule cannot be
dodged by importing late.
"""
from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:          # Python 3.10
    import tomli as tomllib

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "laya_pool"
OURS = {"protocol", "client", "kernels", "worker", "broker", "gateway", "tools", "benchmarks"}

ALLOWED = {           # room -> the packages of ours its modules may import
    "protocol": {"protocol"},
    "kernels": {"kernels", "protocol"},
    "client": {"client", "protocol"},
    "worker": {"worker", "kernels", "protocol"},
    "broker": {"broker", "protocol"},
    "gateway": {"gateway", "client", "protocol"},
    "tools": {"protocol", "client", "kernels", "worker", "broker", "gateway", "tools"},
}
# The operator tools may use the client library, and only its public pool and errors modules; the CLI builds the
# gateway's command (`laya-pool api`) and runs it.
EXCEPTIONS = {"broker/cli.py": {"client.pool", "client.errors", "gateway.options", "gateway.server"},
              "broker/supervisor.py": {"client.pool"}}
NEVER = {"broker": {"torch"}, "protocol": {"torch", "zmq.asyncio"}, "client": {"torch", "transformers", "laya"},
         "gateway": {"torch", "transformers", "laya"}}


def _raw_imports(path: Path) -> set[str]:
    """The modules a file imports, as written (a relative import as its room's name under laya_pool)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
        elif isinstance(node, ast.ImportFrom):
            out.add(f"{PACKAGE}.{path.parent.name}")         # a relative import stays inside its own room
    return out


def _imports(path: Path) -> set[str]:
    """The modules a file imports, ours named by room (`laya_pool.client.pool` -> `client.pool`)."""
    return {n.removeprefix(f"{PACKAGE}.") for n in _raw_imports(path) if n != PACKAGE}


def _modules(room: str) -> list[Path]:
    return sorted((ROOT / PACKAGE / room).glob("*.py"))


@pytest.mark.parametrize("room", sorted(ALLOWED))
def test_room_imports_go_one_way(room):
    bad = []
    for path in _modules(room):
        rel = f"{room}/{path.name}"
        for name in _imports(path):
            top = name.split(".")[0]
            if top in OURS and top not in ALLOWED[room] and name not in EXCEPTIONS.get(rel, set()):
                bad.append(f"{rel} imports {name}")
            if any(name == n or name.startswith(n + ".") for n in NEVER.get(room, ())):
                bad.append(f"{rel} imports {name}")
    assert bad == []


def test_the_rule_sees_a_lazy_import(tmp_path):
    # the checker itself: an import inside a function is still an import
    f = tmp_path / "m.py"
    f.write_text("def later():\n    from worker.runtime import Runtime\n    import torch\n")
    assert {"worker.runtime", "torch"} <= _imports(f)


def test_no_room_is_imported_by_its_bare_name():
    # every Python file of the repository: rooms, tools, tests, benchmarks (not what git ignores: a local .venv,
    # build, or devtools/, where the device's own measuring scripts are copied and import the rooms their way)
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=ROOT, capture_output=True, text=True)
    if tracked.returncode == 0 and tracked.stdout.strip():
        files = [ROOT / line for line in tracked.stdout.split()]
    else:          # not a git checkout (an unpacked sdist): every file but the usual local trees
        files = [p for p in ROOT.rglob("*.py") if not {".venv", "build", "devtools"} & set(p.relative_to(ROOT).parts)]
    bare = [f"{p.relative_to(ROOT)} imports {name}" for p in files for name in _raw_imports(p)
            if name.split(".")[0] in OURS - {"benchmarks"}]
    assert len(files) > 80 and bare == []


def test_the_bare_name_rule_sees_a_bare_import(tmp_path):
    f = tmp_path / "client" / "m.py"
    f.parent.mkdir()
    f.write_text("from client.card import ModelCard\nfrom .card import CardError\n"
                 "from laya_pool.protocol import wire\n")
    assert _raw_imports(f) == {"client.card", "laya_pool.client", "laya_pool.protocol"}


def test_every_room_is_a_subpackage_of_laya_pool():
    # one package as the repository holds it: no package-dir map, no room at the top where it could shadow an
    # installed package of the same name (transformers imports the PyPI package `kernels`)
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in config and config["packages"]["find"]["include"] == [PACKAGE, f"{PACKAGE}.*"]
    assert all((ROOT / PACKAGE / room / "__init__.py").is_file() for room in ALLOWED)
    assert [room for room in ALLOWED if (ROOT / room).exists()] == []


_PROBE = """
import json, sys
import laya_pool.broker.broker, laya_pool.broker.replies, laya_pool.protocol.wire, laya_pool.protocol.contract
print(json.dumps(sorted(m for m in sys.modules
                        if m.split(".")[0] == "torch" or m.split(".")[1:2] in (["worker"], ["kernels"], ["client"]))))
"""


def test_the_broker_process_loads_no_torch_and_no_worker():
    out = subprocess.run([sys.executable, "-c", _PROBE], cwd=ROOT, check=True, capture_output=True, text=True,
                         timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
