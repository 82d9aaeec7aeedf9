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


def test_compile_procs_is_bounded_and_off_by_default():
    from laya_pool.worker.runtime import RuntimeConfig
    assert compile_procs(RuntimeConfig().compile_procs) == 0
    assert compile_procs(0) == 0 and compile_procs(3) == 3
    auto = compile_procs(None)
    assert 0 <= auto <= 8 and auto <= len(os.sched_getaffinity(0))
