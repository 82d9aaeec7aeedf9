"""kernels/launch.py's pure parts: the switches a GEMM plan's key holds and the key a launch is cached under.

The cache itself (compiled kernels launched without Triton's dispatch) runs on the GPU only: tests/test_runtime_gpu.py
compares its bits with Triton's dispatch on every frozen batch.
"""
import os

import torch

from laya_pool.kernels import launch


def test_the_switches_are_read_as_set_now(monkeypatch):
    """(How a setting is read, cached and parsed: tests/test_settings.py.)"""
    monkeypatch.delenv("LAYA_PDL", raising=False)
    before = launch.switches()
    os.environ["LAYA_PDL"] = "0"
    assert launch.switches() != before
    del os.environ["LAYA_PDL"]
    assert launch.switches() == before


def test_the_key_separates_what_triton_specializes_on():
    spec = launch._spec
    buf = torch.empty(64, dtype=torch.float32)
    aligned, offset = buf[:16], buf[1:17]          # 4 bytes off a 16-byte boundary
    assert spec((aligned,)) != spec((offset,))
    assert spec((aligned,)) != spec((aligned.view(torch.int32),))
    # integers: Triton specializes on == 1, divisibility by 16 and width, not on the value
    assert spec((32,)) == spec((48,)) and spec((1,)) != spec((17,)) != spec((16,))
    assert spec((2**31,)) != spec((16,)) and spec((2**63,)) != spec((2**31,))
    assert spec((True,)) != spec((1,)) and spec((0.5,)) == spec((2.0,)) and spec((None,)) != spec((0,))
    assert spec((aligned, object())) is None       # a tensor descriptor: Triton's own dispatch


def test_nothing_is_cached_off_the_gpu():
    assert not launch.cached(torch.device("cpu"))


def test_a_launch_hook_of_any_form_turns_the_cache_off():
    """Triton 3.6 keeps its launch hooks as a chain, and takes a plain function (a debugging hook) or
    None in its place: each is read without an error, and any hook set means Triton's own dispatch (which calls it)."""
    class Chain:
        def __init__(self, calls):
            self.calls = calls
    assert not launch._hooked(Chain([])) and launch._hooked(Chain([print]))
    assert launch._hooked(print) and not launch._hooked(None)
