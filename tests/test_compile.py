"""Compiling the warm-up's kernels ahead in several processes (kernels/compile.py): the pure parts here; the device
part (record, compile in children, the warm-up then compiling nothing) in test_runtime_gpu.py."""
import os
import signal

import pytest

from laya_pool.kernels.compile import Spec, compile_in_processes, confine, deal, marker, procs_for, release, spawn


def specs(n: int, source: str = "s") -> list[Spec]:
    return [Spec(f"m{i % 3}", f"k{i % 5}", f"data{i}", f"key{i}", source) for i in range(n)]


@pytest.mark.parametrize("n,procs", [(1, 8), (7, 3), (24, 8), (5, 5)])
def test_every_specialization_goes_to_exactly_one_share(n, procs):
    shares = deal(specs(n), procs)
    got = sorted(s.key for share in shares for s in share)
    assert got == sorted(s.key for s in specs(n))
    assert len(shares) == min(n, procs)
    sizes = [len(s) for s in shares]
    assert max(sizes) - min(sizes) <= 1


def test_shares_do_not_depend_on_the_order_recorded():
    a = specs(11)
    assert deal(a, 4) == deal(list(reversed(a)), 4)


def test_the_marker_names_the_set_and_the_sources(tmp_path):
    a = specs(6)
    assert marker(a, str(tmp_path)) == marker(list(reversed(a)), str(tmp_path))
    assert marker(a, str(tmp_path)).parent == tmp_path
    assert marker(a, str(tmp_path)) != marker(a[:5], str(tmp_path))            # a kernel more to compile
    assert marker(a, str(tmp_path)) != marker(specs(6, "edited"), str(tmp_path))   # a kernel's source changed


def test_compile_procs_is_bounded_and_one_per_spare_core_by_default():
    from laya_pool.worker.runtime import RuntimeConfig
    auto = procs_for(RuntimeConfig().compile_procs)
    assert auto == min(8, len(os.sched_getaffinity(0)) - 1)
    assert procs_for(0) == 0 and procs_for(3) == 3


def test_children_started_early_and_given_no_work_are_all_reaped():
    """A worker starts its compile processes before it knows their work (its first step); a warm cache or a forward
    without Triton kernels gives them none. They must all be gone after, none left importing or waiting."""
    children = spawn(2)
    assert all(p.poll() is None for p in children)          # alive, waiting for work
    assert compile_in_processes([], 2, ("cuda", 90, 32), children=children) == {"kernels": 0, "cached": True}
    assert [p.returncode for p in children] == [-signal.SIGKILL] * 2       # stopped, not waited for
    assert all(p.stdin.closed and p.stdout.closed for p in children)


def test_a_child_told_there_is_no_work_leaves_cleanly_without_a_device():
    """The child's own side: its stdin closed empty (its worker left before the warm-up), it exits 0 after its imports,
    saying it compiled nothing; it opens no CUDA context (none exists on this machine)."""
    (child,) = spawn(1)
    child.stdin.close()
    assert child.wait(timeout=120) == 0
    assert child.stdout.read().decode().split() == ["compiled", "0", "of", "0"]
    release([child])


_DEFERRED = r"""
import sys
from laya_pool.kernels import compile
compile.defer_torch()
import importlib
for name in sys.argv[1:]:
    importlib.import_module("laya_pool.kernels." + name)
print("deferred" if isinstance(sys.modules["torch"], compile._Deferred) else "loaded")
import torch
from laya_pool.kernels import launch
print(torch.zeros(2).sum().item(), launch.torch.ones(1).sum().item(), type(sys.modules["torch"]).__name__)
"""


def kernel_modules() -> list[str]:
    """The kernels' modules that define Triton functions: what a compile child imports (a spec's module)."""
    from pathlib import Path

    import laya_pool.kernels as k
    return sorted(p.stem for p in Path(k.__path__[0]).glob("*.py") if "@triton.jit" in p.read_text())


def test_a_child_imports_every_kernel_module_without_loading_torch():
    """A compile child's start is Python and Triton, not torch's import (kernels/compile.py `defer_torch`): every
    module that holds a Triton kernel imports with torch deferred, and torch still works when something uses it. A
    kernel module that imports a torch submodule at its top (`import torch.nn.functional as F`) fails this."""
    import subprocess
    import sys
    modules = kernel_modules()
    assert {"attention", "gemm", "launch", "rows"} <= set(modules)
    out = subprocess.run([sys.executable, "-c", _DEFERRED, *modules], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["deferred", "0.0", "1.0", "module"]


def test_release_stops_children_at_once_whatever_they_are_doing():
    """Released children are killed where they are (importing, or waiting for work): a warm start does not wait for
    their imports; none had work, so nothing is lost."""
    children = spawn(3)
    release(children)
    assert [p.returncode for p in children] == [-signal.SIGKILL] * 3


_KEYS = r"""
import sys
from laya_pool.kernels import attention, exact, gemm, launch, rows
first = {"gelu": exact._gelu_kernel, "gemm": gemm._gemm_kernel, "norm": rows._layer_norm_kernel}[sys.argv[1]]
first.cache_key
print(gemm._gemm_kernel.cache_key, rows._layer_norm_kernel.cache_key, attention._attention_kernel.cache_key)
"""


def test_kernel_keys_do_not_depend_on_which_kernel_a_process_touched_first():
    """Triton folds a helper's constants into its caller's key only if the helper's key came first, so a worker
    (GELU checked at load) and a compile-ahead child (a GEMM first) named the same kernel differently, and the
    warm-up compiled again what the children had compiled (31 of 35 kernels on an H200). Each process starts from
    another kernel; every key must agree (without kernels/launch.py settle_keys the GEMM's differs)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}    # the interpreter has no keys
    keys = {tuple(subprocess.run([sys.executable, "-c", _KEYS, first], env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.split()[-3:]) for first in ("gelu", "gemm", "norm")}
    assert len(keys) == 1, keys


def test_children_started_before_pinning_are_moved_onto_the_workers_cpus_and_cut_to_its_count():
    """Spawned before the worker pins itself (and counted from the whole host then): after pinning the kept ones run on
    the worker's CPUs only, and those past the pinned set's count are released."""
    cpu = sorted(os.sched_getaffinity(0))[0]
    children = spawn(3)
    try:
        kept = confine(children, [cpu], 2)
        assert kept == children[:2]
        assert children[2].returncode == -signal.SIGKILL
        assert all(os.sched_getaffinity(p.pid) == {cpu} for p in kept)
    finally:
        release(children)


def test_a_warm_up_without_kernels_to_compile_lets_early_children_go(tiny_ckpt):
    """A runtime whose warm-up compiles nothing (the CPU here: no Triton kernels) reaps the children it was given."""
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime
    children = spawn(2)
    Runtime(load_checkpoint(tiny_ckpt), device="cpu").warmup(compilers=children)
    assert [p.returncode for p in children] == [-signal.SIGKILL] * 2


@pytest.mark.parametrize("device,early,want", [("cpu", "1", False), ("cuda:0", "0", False), ("cuda:0", None, False)])
def test_a_worker_starts_children_early_only_on_cuda_and_when_asked(monkeypatch, device, early, want):
    from laya_pool.worker.server import WorkerConfig, _start_compilers, build_parser
    if early is None:
        monkeypatch.delenv("LAYA_COMPILE_EARLY", raising=False)        # the default: off (decision 0016)
    else:
        monkeypatch.setenv("LAYA_COMPILE_EARLY", early)
    cfg = WorkerConfig.from_args(build_parser().parse_args(["--model", "m", "--backend", "b", "--id", "0"]))
    assert (_start_compilers(cfg, device) is not None) == want


def test_a_cuda_worker_asked_to_starts_its_children_first(monkeypatch):
    """The switch on and a CUDA device: the children exist before any model or torch import of the worker's (this CPU
    machine has no GPU, but starting them needs none: they open a context only with work)."""
    from laya_pool.worker.server import WorkerConfig, _start_compilers, build_parser
    monkeypatch.setenv("LAYA_COMPILE_EARLY", "1")
    cfg = WorkerConfig.from_args(build_parser().parse_args(["--model", "m", "--backend", "b", "--id", "0",
                                                            "--compile-procs", "2"]))
    children = _start_compilers(cfg, "cuda:0")
    try:
        assert children is not None and len(children) == 2 and all(p.poll() is None for p in children)
    finally:
        release(children or [])
