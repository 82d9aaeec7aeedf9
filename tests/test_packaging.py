"""The wheel as a user gets it: one package of ours (laya_pool) in site-packages, a client-only base install.

The wheel is built offline from a copy of this checkout and installed (--no-deps) into a fresh virtual
environment; its own site-packages must hold laya_pool and its dist-info, nothing else. That environment sees
the test environment's packages (pyzmq, numpy, torch, ...) behind its own, so the installed package is also
run: imported from outside the checkout (the copy in the venv, not this tree), and its `laya-pool` program
writes a checkpoint with an installed tool. The base requirements are resolved through the installed
distributions' metadata, transitively: no torch, no CUDA anywhere in the closure.
"""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from importlib import metadata
from pathlib import Path

import pytest
from packaging.markers import Marker
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("protocol", "client", "kernels", "worker", "broker", "gateway", "tools")
BASE = {"pyzmq", "msgpack", "numpy", "tokenizers"}
HEAVY = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*|jax.*|tensorflow.*)$")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    # Built from a copy: building in place would leave build/ and *.egg-info in the checkout.
    src = tmp_path_factory.mktemp("src")
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("pyproject.toml", "README.md", "laya_pool", "benchmarks"):       # (benchmarks/: kept out)
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy(ROOT / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                        "-v", "-w", str(out), str(src)], check=True, capture_output=True, text=True, timeout=120)
    (out / "build.log").write_text(r.stdout + r.stderr)       # the backend's output (-v), for the warnings test
    (whl,) = out.glob("laya_pool-*.whl")
    return whl


def test_building_the_wheel_warns_of_nothing_in_our_configuration(wheel):
    """setuptools says nothing about pyproject.toml (the license's form, data directories without __init__.py)."""
    log = (wheel.parent / "build.log").read_text()
    warnings = [ln.strip() for ln in log.splitlines() if re.search(r"Warning\b|Package would be ignored", ln)]
    assert not warnings, "\n".join(warnings)


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> tuple[Path, list[str]]:
    """A fresh environment with the wheel installed, and what its site-packages held right after the install.
    Then a .pth line puts this environment's packages (pyzmq, numpy, torch, ...) behind its own, to run it."""
    env = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=120)
    python = env / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q",
                    str(wheel)], check=True, capture_output=True, timeout=120)
    site = _site_packages(env)
    listing = sorted(p.name for p in site.iterdir() if p.name != "__pycache__")
    (site / "zz-test-deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return env, listing


def _site_packages(env: Path) -> Path:
    out = subprocess.run([str(env / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                         check=True, capture_output=True, text=True)
    return Path(out.stdout.strip())


def test_the_wheel_holds_one_package_with_every_room(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"laya_pool"} and len(tops) == 2, tops
    want = {p.relative_to(ROOT).as_posix() for room in ROOMS for p in (ROOT / "laya_pool" / room).glob("*.py")}
    assert want <= set(names), sorted(want - set(names))
    assert {"laya_pool/__init__.py", "laya_pool/__main__.py", "laya_pool/py.typed",
            "laya_pool/tools/cases/requests.json"} <= set(names)


def test_the_benchmarks_are_not_in_the_wheel(wheel):
    # benchmarks/ is the checkout's: it is run from there (python -m benchmarks.NAME), never installed
    assert (ROOT / "benchmarks" / "README.md").is_file()
    assert not [n for n in zipfile.ZipFile(wheel).namelist() if "benchmarks" in n.split("/")]


def test_site_packages_gets_laya_pool_and_nothing_else(venv):
    env, ours = venv
    assert len(ours) == 2 and ours[0] == "laya_pool" and re.fullmatch(r"laya_pool-[\d.]+\.dist-info", ours[1]), ours
    assert (env / "bin" / "laya-pool").is_file()


def test_the_installed_package_runs_outside_the_checkout(venv, tmp_path):
    env = venv[0]
    probe = """
import json, sys
import laya_pool
from laya_pool import AsyncClient, Client, local_pool, PoolError, RequestFailed, PoolUnavailable
import laya_pool.client.errors, laya_pool.broker.broker, laya_pool.broker.cli
assert laya_pool.client.errors.PoolError is PoolError and issubclass(RequestFailed, PoolError)
laya_pool.broker.cli.build_parser()
mods = sorted(m for m in sys.modules if m.split(".")[0] in ("protocol", "client", "kernels", "worker", "broker",
                                                             "gateway"))
print(json.dumps({"file": laya_pool.__file__, "path": list(laya_pool.__path__), "bare": mods,
                  "server_only": [m for m in ("torch", "psutil", "prometheus_client", "safetensors", "cuda", "triton",
                                              "fastapi", "starlette", "uvicorn") if m in sys.modules]}))
"""
    out = subprocess.run([str(env / "bin" / "python"), "-c", probe], cwd=tmp_path, check=True, capture_output=True,
                         text=True, timeout=120)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    site = str(_site_packages(env))
    assert got["file"].startswith(site) and got["path"] == [str(Path(site) / "laya_pool")]
    # the client, a broker alone and the operator CLI (its parser holds `api`'s flags) run on the base install
    assert got["bare"] == [] and got["server_only"] == []


def test_the_tools_run_from_the_installed_program(venv, tmp_path):
    laya_pool = str(venv[0] / "bin" / "laya-pool")
    listing = subprocess.run([laya_pool, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    for command in ("up", "status", "make-checkpoint", "bench", "load", "compare-workers", "demo"):
        assert re.search(rf"^\s+{command}\b|\b{command}\b", listing.stdout, re.M), command
    subprocess.run([laya_pool, "make-checkpoint", "--out", str(tmp_path / "ck"), "--preset", "tiny", "--seed", "3"],
                   cwd=tmp_path, check=True, capture_output=True, timeout=120)
    assert (tmp_path / "ck" / "model.safetensors").is_file() and (tmp_path / "ck" / "tokenizer").is_dir()


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def closure(requirements: list[str], extras: tuple[str, ...] = ()) -> set[str]:
    """Every distribution `requirements` pull in, transitively, read from the installed distributions' metadata
    (offline); extras are followed where a requirement asks for them."""
    seen: set[str] = set()
    todo = [(r, extras) for r in requirements]
    while todo:
        text, wanted = todo.pop()
        req = Requirement(text)
        env = {"extra": ""}
        if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in ("", *wanted)):
            continue
        name = _norm(req.name)
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            continue                # not installed here: its own requirements are unknown, its name still counts
        todo.extend((r, tuple(req.extras)) for r in dist.requires or [])
    return {k.split("[")[0] for k in seen}


def test_the_base_install_has_no_torch(wheel):
    reqs = _requirements(wheel)
    base = [r for r in reqs if "extra ==" not in r]
    assert {_norm(Requirement(r).name) for r in base} == BASE
    pulled = closure(base)
    assert BASE <= pulled and not [n for n in pulled if HEAVY.match(n)], sorted(pulled)
    server = [r for r in reqs if ";" in r and Marker(r.split(";", 1)[1]).evaluate({"extra": "server"})]
    assert "torch" in {_norm(Requirement(r).name) for r in server}


def test_the_closure_sees_torch_behind_an_extra():
    # the check above can fail: a requirement whose extra brings torch is followed to it
    if not any("torch" in (r or "") for r in metadata.distribution("safetensors").requires or []):
        pytest.skip("this safetensors declares no torch extra")
    assert "torch" in closure(["safetensors[torch]"]) and "torch" not in closure(["safetensors"])



_NO_TORCH = """
import importlib.util, sys
find_spec = importlib.util.find_spec
importlib.util.find_spec = lambda name, *a: None if name == "torch" else find_spec(name, *a)   # a client install
from laya_pool.__main__ import main
sys.exit(main(["up", "--model", "unused"]))
"""


def test_up_on_a_client_install_names_the_server_extra():
    r = subprocess.run([sys.executable, "-c", _NO_TORCH], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "laya-pool[server]" in r.stderr and "torch" in r.stderr, r.stderr


_NO_SERVER = """
import sys
class ClientInstall:                     # torch, safetensors, ... are not installed: importing one fails as it would
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "safetensors", "psutil", "prometheus_client", "cuda", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, ClientInstall())
from laya_pool.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


def test_make_checkpoint_on_a_client_install_names_the_server_extra(tmp_path):
    r = subprocess.run([sys.executable, "-c", _NO_SERVER, "make-checkpoint", "--out", str(tmp_path / "ck")],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip() == ("laya-pool make-checkpoint needs the server install (safetensors missing): "
                                "pip install 'laya-pool[server]'"), r.stderr


def test_the_readme_says_which_errors_bad_input_raises(tiny_ckpt):
    """Input the client refuses raises the SDK's types, which are not PoolErrors: the README says so, naming each."""
    from laya_pool import PoolError, QuestionError
    from laya_pool.client.card import ModelCard
    from laya_pool.client.semantics import encode_request
    card = ModelCard.from_dir(tiny_ckpt, fingerprint="-")
    raised = []
    for state, questions in (("x", {"q": {"type": "maybe", "instructions": "?"}}), (None, {}), ("x", [])):
        with pytest.raises(Exception) as e:
            encode_request(card, state, questions)
        raised.append(e.value)
    assert [type(e) for e in raised] == [QuestionError, TypeError, TypeError], raised
    assert not any(isinstance(e, PoolError) for e in raised)
    text = " ".join((ROOT / "README.md").read_text().split())
    errors = text[text.index("raises a `laya_pool.PoolError`"):][:900]
    for name in ("QuestionError", "TypeError", "SchemaError", "ValueError"):
        assert f"`{name}`" in errors, f"the README's paragraph on errors does not name {name}"
    assert "Every error a call raises is a" not in text


def test_every_error_a_client_can_meet_is_importable_from_laya_pool():
    import ast
    import importlib
    import inspect

    import laya_pool
    errors = set()
    for room in ("client", "protocol"):
        for path in sorted((ROOT / "laya_pool" / room).glob("*.py")):
            module = importlib.import_module(f"laya_pool.{room}.{path.stem}")
            errors |= {name for name, obj in vars(module).items() if inspect.isclass(obj)
                       and issubclass(obj, BaseException) and obj.__module__ == module.__name__}
    assert {"PoolError", "RequestFailed", "PoolUnavailable", "QuestionError", "ProtocolError"} <= errors
    assert errors <= set(laya_pool.__all__), (
        f"add {sorted(errors - set(laya_pool.__all__))} to laya_pool/__init__.py: __all__, _EXPORTS, TYPE_CHECKING")
    # each public name is the defining module's object, and type checkers see the same names (TYPE_CHECKING block)
    for name in laya_pool.__all__:
        module = importlib.import_module(f"laya_pool.{laya_pool._EXPORTS[name]}")
        assert getattr(laya_pool, name) is getattr(module, name)
    init = ast.parse((ROOT / "laya_pool" / "__init__.py").read_text())
    typed = {a.asname or a.name for node in ast.walk(init) if isinstance(node, ast.ImportFrom) and node.level
             for a in node.names}
    assert typed == set(laya_pool.__all__) == set(laya_pool._EXPORTS)
