"""Compiling the fast path's kernels before their first launch, in several processes at once.

A worker on a fresh machine (Triton's on-disk cache empty) would spend ~30 s of its start compiling the kernel
specializations of its warm-up one after another (READY 43.9 s after `up` on an H200, the warm-up 30.7 s of it).
Triton compiles holding the GIL, so threads do not help; processes might:

1. `recorded()` runs the warm-up's forwards with every launch of a kernel that is not compiled yet recorded and
   skipped (Triton's `jit_cache_hook`): the list of what the warm-up needs, in well under a second, nothing launched.
2. `compile_in_processes` deals the list out to child processes, each compiling its share into the shared on-disk
   cache, for the worker's device's target, from the signature, constants, attributes and options the hook saw, and
   building each kernel's launcher (a C module Triton compiles with the host's compiler and caches on disk beside it).
3. The warm-up proper then finds every kernel on disk, because a Triton function's key does not depend on which
   kernel the process touched first (kernels/launch.py `settle_keys`, which every kernel module calls at import;
   without it the warm-up compiled 31 of 35 again). `log_keys` (LAYA_COMPILE_KEYS=FILE) logs each key's parts in the
   parent and the children, to compare them.

A failed child costs nothing but time: whatever it did not compile, the warm-up compiles as before.

A child's own start bounds the compile phase as much as its kernels do (15 processes took as long as 8 when each
imported torch and opened a CUDA context, ~4-5 s on the device hosts; docs/decisions/0016-compile-ahead.md). A child
needs neither torch nor a device to compile (Triton compiles for a named target and builds a launcher without either),
so it defers torch (`defer_torch`) and starts in Python and Triton's time (~0.1-0.5 s). The children may also be started
before the work is known (`spawn` first, `compile_in_processes(..., children=)`; a worker's LAYA_COMPILE_EARLY): they
wait for their share on stdin, and one given none leaves at once (a warm cache, or a forward without Triton kernels).
This module imports nothing heavy at its own import, so a worker can spawn before it imports torch.
"""
from __future__ import annotations

import contextlib
import hashlib
import importlib
import importlib.util
import json
import os
import pickle
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from laya_pool.protocol import settings


def triton_knobs():
    """Triton's knobs, or None where Triton is not installed (CPU-only installs; only the CUDA path needs it). Imported
    on use, not with this module (the module docstring says why)."""
    try:
        from triton import knobs
    except ImportError:
        return None
    return knobs


def procs_for(asked: int | None) -> int:
    """How many compile processes a warm-up starts for `asked` (a worker's --compile-procs): None, one per spare core
    of this process's CPUs, at most 8; 0 or 1: none."""
    if asked is not None:
        return max(0, asked)
    return max(0, min(8, len(os.sched_getaffinity(0)) - 1))


@dataclass(frozen=True)
class Spec:
    """One kernel specialization: the kernel's module and name, what Triton compiles it from (`data`: its signature,
    constants, attributes and options, pickled as Triton holds them: only ever sent to our own child process), and what
    names it in a cache (the kernel source's hash and the specialization's key)."""
    module: str
    name: str
    data: bytes
    key: str
    source: str


@contextlib.contextmanager
def recorded() -> Iterator[list[Spec]]:
    """Within the block, a launch of a kernel that this process has not compiled yet is recorded (once per
    specialization) and skipped: nothing runs on the device and nothing is compiled."""
    specs: list[Spec] = []
    seen: set[tuple[str, str, str]] = set()

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled) -> bool:  # noqa: A002 - Triton's names
        jit = fn.jit_function
        k = (jit.fn.__module__, jit.fn.__qualname__, str(key))
        if k not in seen:
            seen.add(k)
            options = _tuples(json.loads(compile["specialization_data"])["options"])
            data = pickle.dumps((compile["signature"], compile["constants"], compile["configs"][0], options))
            specs.append(Spec(k[0], k[1], data, k[2], jit.cache_key))
        return True                 # skip: the kernel is neither compiled nor launched

    from .launch import RECORDING
    knobs = triton_knobs()
    before = knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = hook
    RECORDING.append(hook)        # kernels/launch.py `through_triton`: a kernel compiled already is not launched either
    try:
        yield specs
    finally:
        RECORDING.pop()
        knobs.runtime.jit_cache_hook = before


def recording() -> bool:
    """Whether a `recorded` block is open: launches are skipped, so nothing computed now can be read back."""
    from .launch import RECORDING
    return bool(RECORDING)


def deal(specs: list[Spec], procs: int) -> list[list[Spec]]:
    """`specs` in `procs` shares, round-robin over a fixed order so each kernel's variants spread over every share
    (a GEMM variant costs several times a row kernel's); pure, so it is tested alone."""
    ordered = sorted(specs, key=lambda s: (s.module, s.name, s.key))
    shares = [ordered[i::procs] for i in range(procs)]
    return [s for s in shares if s]


def marker(specs: list[Spec], cache_dir: str) -> Path:
    """The file that says every one of `specs` is in `cache_dir` (written after the children compiled them all): a
    restart on a warm machine starts no children. It lives in the cache, so it goes when the cache is cleared, and
    it names the kernels' sources, so an edited kernel is compiled again."""
    h = hashlib.sha256("\n".join(sorted(f"{s.module}.{s.name} {s.source} {s.key}" for s in specs)).encode())
    return Path(cache_dir) / f"laya-pool-warm-{h.hexdigest()[:32]}"


def spawn(procs: int) -> list[subprocess.Popen]:
    """`procs` compile processes, each importing what it compiles with and then waiting for its share on stdin
    (`_child`); they may be started before the work is known (the module docstring)."""
    if settings.get("LAYA_COMPILE_KEYS"):
        log_keys(settings.get("LAYA_COMPILE_KEYS"))      # children inherit the variable and log theirs
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    started: list[subprocess.Popen] = []
    try:
        for _ in range(max(1, procs)):
            started.append(subprocess.Popen([sys.executable, "-m", __spec__.name if __spec__ else __name__],
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                            stderr=subprocess.DEVNULL, env=env))
    except BaseException:
        release(started)          # (out of processes or files half way: none of them left behind)
        raise
    return started


def confine(children: list[subprocess.Popen], cpus: list[int] | None, keep: int) -> list[subprocess.Popen]:
    """Children started before their worker pinned itself (`spawn` comes first): moved onto the worker's CPUs (where
    they would have started before; other workers serve on the rest of the host), and cut to `keep` (`procs_for`
    counted the whole host's CPUs then, the pinned set now); the rest released. The ones kept."""
    release(children[max(0, keep):])
    kept = children[:max(0, keep)]
    if cpus:
        for p in kept:
            with contextlib.suppress(OSError):        # (one that died already: its share fails, and is compiled later)
                os.sched_setaffinity(p.pid, cpus)
    return kept


def release(children: list[subprocess.Popen]) -> None:
    """Children given no work, stopped where they are: at most importing (none opens a CUDA context before it has
    work), so nothing is lost, and a warm start does not wait for their imports to finish."""
    for p in children:
        if p.poll() is None:
            p.kill()
    for p in children:
        p.wait()
        for f in (p.stdin, p.stdout):
            with contextlib.suppress(OSError):        # (a pipe to a child that died mid-write)
                f.close()


def compile_in_processes(specs: list[Spec], procs: int, target: tuple, timeout: float = 300.0,
                         children: list[subprocess.Popen] | None = None) -> dict:
    """Compile `specs` for `target` (`target_of` the worker's device) into Triton's on-disk cache in up to `procs`
    child processes (`children`: started already, by `spawn`), unless a marker says they are there; returns what
    happened: {"kernels", "procs", "seconds", "failed", "early"} ("failed": children that did not finish cleanly;
    "early": whether they were started before the work was known) or {"kernels", "cached": True}. Every child given
    is reaped, with work or without."""
    t = time.perf_counter()
    early = bool(children)
    done = marker(specs, triton_knobs().cache.dir) if specs else None
    if done is None or done.exists():
        if children:
            release(children)
        return {"kernels": len(specs), "cached": True}
    shares = deal(specs, len(children) if early else max(1, procs))
    if early:
        release(children[len(shares):])                # (more children than kernels)
        children = children[:len(shares)]
    else:
        children = spawn(len(shares))
    failed = _finish(children, target, shares, time.monotonic() + timeout)
    if not failed:
        done.parent.mkdir(parents=True, exist_ok=True)
        done.write_text(f"{len(specs)} kernel specializations compiled by laya-pool's worker\n")
    return {"kernels": len(specs), "procs": len(shares), "seconds": round(time.perf_counter() - t, 2),
            "failed": failed, "early": early}


def _finish(children: list[subprocess.Popen], target: tuple, shares: list[list[Spec]], deadline: float) -> int:
    """Feed each child the target and its share, and wait for all until `deadline`; how many did not finish
    cleanly."""
    failed = 0
    try:
        for p, share in zip(children, shares):   # all fed first: each compiles while the next is fed
            with contextlib.suppress(BrokenPipeError):        # (a child that died: counted below)
                p.stdin.write(pickle.dumps((target, [(s.module, s.name, s.data) for s in share])))
                p.stdin.close()
        for p in children:
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            out = p.stdout.read().decode(errors="replace").split()
            ok = p.returncode == 0 and len(out) == 4 and out[0] == "compiled" and out[1] == out[3]
            failed += not ok
    finally:                 # whatever went wrong, no child is left behind
        release(children)
    return failed


def log_keys(path: str) -> None:
    """Diagnostic (LAYA_COMPILE_KEYS=FILE): append the parts of every on-disk cache key this process computes to FILE,
    one JSON line each, so the parent's and the children's keys of one kernel can be compared part by part."""
    import triton.compiler.compiler as cc
    from triton.runtime.cache import triton_key
    original = cc.get_cache_key
    if getattr(original, "logged", False):
        return

    def logged(src, backend, options, env_vars):
        parts = {"pid": os.getpid(), "fn": getattr(src, "name", "?"), "triton": hashlib.sha256(
            triton_key().encode()).hexdigest()[:12], "src": src.hash()[:12], "fn_key": src.fn.cache_key[:12],
            "fn_src": hashlib.sha256(src.fn.src.encode()).hexdigest()[:12], "line": src.fn.starting_line_number,
            "module": f"{src.fn.fn.__module__} {src.fn.fn.__code__.co_filename}",
            "globals": str([(n, repr(v)[:40]) for (n, _), (v, _) in src.fn.used_global_vals.items()])[:300],
            "attrs": str(src.attrs)[:200], "constants": str(sorted(src.constants.items()))[:300],
            "backend": backend.hash(), "options": options.hash()[:12], "extern_libs": str(options.extern_libs),
            "env": str(sorted(env_vars.items()))}
        with open(path, "a") as f:
            f.write(json.dumps(parts) + "\n")
        return original(src, backend, options, env_vars)

    logged.logged = True
    cc.get_cache_key = logged


def _tuples(x):
    """JSON's lists back to the tuples Triton's options hold."""
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else (
        {k: _tuples(v) for k, v in x.items()} if isinstance(x, dict) else x)


class _Deferred(types.ModuleType):
    """torch, in a compile child, until something asks it for a name: then imported for real, and the name given."""

    def __getattr__(self, name: str):
        if sys.modules.get("torch") is self:     # (the first use; later ones come through modules that hold the stub)
            del sys.modules["torch"]
        return getattr(importlib.import_module("torch"), name)


def defer_torch() -> None:
    """Make `import torch` cost nothing in this process until torch is used. A child compiles with Triton alone, for a
    target its worker names: no torch, no CUDA context. Our kernels' modules import torch at the top but use it only in
    functions (none imports a torch submodule at its top), so a child that imports them to compile their kernels never
    loads it: its start is Python and Triton (~0.1-0.5 s), not torch's import and a context (~4-5 s on the device hosts;
    the compile phase 11.4 -> 6.0 s on an H100). Anything that does use torch gets the real module, only later."""
    if "torch" not in sys.modules:
        stub = _Deferred("torch")
        stub.__spec__ = importlib.util.find_spec("torch")
        sys.modules["torch"] = stub


def target_of(device: int) -> tuple:
    """The compile target of this process's CUDA device `device`, as the children take it: (backend, arch, warp
    size), what Triton's driver says a launch there compiles for."""
    import torch
    from triton.runtime.driver import driver
    with torch.cuda.device(device):
        t = driver.active.get_current_target()
    return (t.backend, t.arch, t.warp_size)


def _child() -> int:
    """A child: compile the specializations read from stdin for the target sent with them; print "compiled N of M". The
    imports come first (what an early child does while its worker loads); no torch, no CUDA context (`defer_torch`)."""
    defer_torch()
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile, make_backend
    except ImportError:            # (no Triton: no work can come either)
        GPUTarget = None
    data = sys.stdin.buffer.read()
    if not data:
        print("compiled 0 of 0")
        return 0
    if settings.get("LAYA_COMPILE_KEYS"):
        log_keys(settings.get("LAYA_COMPILE_KEYS"))
    target, todo = pickle.loads(data)
    target = GPUTarget(*target)
    backend = make_backend(target)
    done = 0
    for module, name, data in todo:
        try:
            # What JITFunction._do_compile does with the same objects (Triton's JSON `preload` does not give the
            # same on-disk cache key: the warm-up then compiled 31 of 35 kernels again).
            fn = getattr(importlib.import_module(module), name)
            signature, constants, attrs, options = pickle.loads(data)
            options = backend.parse_options(options)
            kernel = compile(ASTSource(fn, signature, constants, attrs), target=target, options=options.__dict__)
            _launcher(target, kernel)
            done += 1
        except Exception as e:  # noqa: BLE001 - the warm-up compiles what a child could not
            print(f"{module}.{name}: {type(e).__name__}: {e}", file=sys.stderr)
    print(f"compiled {done} of {len(todo)}")
    return 0


def _launcher(target, kernel) -> None:
    """The kernel's launcher: a small C module per signature that Triton builds with the host's C compiler on a
    kernel's first launch and caches on disk beside the binary, built here from what the compiled kernel says (no
    device: its driver, which a launch would ask, imports torch)."""
    if target.backend == "cuda":
        from triton.backends.nvidia.driver import CudaLauncher
        CudaLauncher(kernel.src, kernel.metadata)


if __name__ == "__main__":
    sys.exit(_child())
