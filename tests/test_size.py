"""Sizes that keep the package readable: no function over 60 lines and no class over 400 in laya_pool/ (ast, not a
run). A Triton kernel (`@triton.jit`) is one kernel however long, so its body does not count, alone or inside the
function that builds it. Only the files named in ALLOWED are left out, each with why."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "laya_pool"
MAX_FUNCTION = 60       # lines, from `def` to its last line
MAX_CLASS = 400         # lines, from `class` to its last line

ALLOWED = {
    # Split by the fast-numerics work that owns these two files.
    "kernels/fast.py": "split with the fast numerics",
    "kernels/gemm.py": "split with the fast numerics",
}


def _is_kernel(node: ast.AST) -> bool:
    """A Triton kernel: a function decorated `@triton.jit` (or `@triton.jit(...)`)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    return any(ast.unparse(d.func if isinstance(d, ast.Call) else d) == "triton.jit" for d in node.decorator_list)


def _lines(node: ast.AST) -> int:
    """`node`'s lines without the kernels inside it."""
    kernels = [n for n in ast.walk(node) if n is not node and _is_kernel(n)]
    outer = [k for k in kernels if not any(o is not k and k in ast.walk(o) for o in kernels)]
    return node.end_lineno - node.lineno + 1 - sum(k.end_lineno - k.lineno + 1 for k in outer)


def oversized(path: Path, rel: str) -> list[str]:
    """`rel:line kind name (lines > limit)` for each function or class of `path` over its limit."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if _is_kernel(node):
            continue
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", MAX_FUNCTION
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", MAX_CLASS
        else:
            continue
        n = _lines(node)
        if n > limit:
            out.append(f"{rel}:{node.lineno} {kind} {node.name} ({n} lines > {limit})")
    return out


def test_no_function_over_60_lines_and_no_class_over_400():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel not in ALLOWED:
            found += oversized(path, rel)
    assert not found, "split these along their jobs:\n" + "\n".join(found)


def test_the_allowed_files_exist():
    """An entry left behind after its file was split or moved is removed, not kept as a blank cheque."""
    assert all((PACKAGE / rel).is_file() for rel in ALLOWED), [rel for rel in ALLOWED if not (PACKAGE / rel).is_file()]


def _planted(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "planted.py"
    path.write_text(body, encoding="utf-8")
    return oversized(path, "planted.py")


@pytest.mark.parametrize("n,found", [(MAX_FUNCTION - 1, False), (MAX_FUNCTION, True), (MAX_FUNCTION + 30, True)])
def test_a_planted_long_function_is_found(tmp_path, n, found):
    """`def` plus n statements: 60 lines pass, 61 do not (inside a class too)."""
    body = "def long():\n" + "".join(f"    x{i} = {i}\n" for i in range(n))
    want = [f"planted.py:1 function long ({n + 1} lines > {MAX_FUNCTION})"] if found else []
    assert _planted(tmp_path, body) == want
    method = "class C:\n    def long(self):\n" + "".join(f"        x{i} = {i}\n" for i in range(n))
    assert _planted(tmp_path, method) == ([f"planted.py:2 function long ({n + 1} lines > {MAX_FUNCTION})"]
                                          if found else [])


def test_a_planted_long_class_is_found(tmp_path):
    methods = "".join(f"    def m{i}(self):\n        return {i}\n\n" for i in range(140))     # 420 lines
    found = _planted(tmp_path, "class Big:\n" + methods)
    assert len(found) == 1 and found[0].startswith("planted.py:1 class Big (")


def test_a_triton_kernel_body_does_not_count(tmp_path):
    """A kernel is exempt by its decorator, alone or inside the function that builds it; a function beside it that
    only looks like one is not."""
    kernel = "".join(f"        x{i} = {i}\n" for i in range(100))
    body = ("import triton\n\n\ndef build():\n    @triton.jit\n    def k(X):\n" + kernel + "    return k\n\n\n"
            "@triton.jit\ndef top(X):\n" + kernel.replace("        ", "    ") + "\n\n"
            "@triton.autotune(configs=[], key=[])\n@triton.jit(do_not_specialize=[0])\ndef tuned(X):\n"
            + kernel.replace("        ", "    ") + "\n\n@other.jit\ndef not_a_kernel(X):\n"
            + kernel.replace("        ", "    "))
    found = _planted(tmp_path, body)
    assert len(found) == 1 and "function not_a_kernel" in found[0], found
