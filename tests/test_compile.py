"""Compiling the warm-up's kernels ahead in several processes (kernels/compile.py): the pure parts here; the device
part (record, compile in children, the warm-up then compiling nothing) in test_runtime_gpu.py."""
import os

import pytest
from laya_pool.kernels.compile import Spec, deal, marker
from laya_pool.worker.runtime import compile_procs


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
    auto = compile_procs(RuntimeConfig().compile_procs)
    assert auto == min(8, len(os.sched_getaffinity(0)) - 1)
    assert compile_procs(0) == 0 and compile_procs(3) == 3


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
    warm-up compiled again what the children had compiled (H200, fourteenth session). Each process starts from
    another kernel; every key must agree (without kernels/launch.py settle_keys the GEMM's differs)."""
    pytest.importorskip("triton")
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}    # the interpreter has no keys
    keys = {tuple(subprocess.run([sys.executable, "-c", _KEYS, first], env=env, capture_output=True, text=True,
                           check=True, timeout=120).stdout.split()[-3:]) for first in ("gelu", "gemm", "norm")}
    assert len(keys) == 1, keys
