"""How the fast path's kernels are launched: one place for the launch-time switches.

Programmatic dependent launch (PDL, Hopper and later): each kernel is launched while its predecessor is
still finishing, and waits (`griddepcontrol.wait`) before it touches memory, so the launch latency and the
block scheduling of ~200 small kernels overlap the kernels before them. Every kernel of the fast path waits
first thing, so no kernel reads or writes anything before all earlier kernels have finished: the result is
the same bits with or without it. `LAYA_PDL=0` turns it off (for measuring the difference).
"""
from __future__ import annotations

import os

import torch


def gdc(device: torch.device) -> bool:
    """Whether kernels on `device` wait for their predecessors in-kernel (so may be launched with PDL)."""
    if device.type != "cuda" or os.environ.get("LAYA_PDL", "1") == "0":
        return False
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _HOPPER:          # asked on every launch: read the device once
        _HOPPER[i] = torch.cuda.get_device_capability(i)[0] >= 9
    return _HOPPER[i]


_HOPPER: dict[int, bool] = {}


def launch(device: torch.device, programs: int) -> dict:
    """Launch options for a kernel of `programs` blocks. Only a grid of at most one block per SM is launched
    early: a larger grid's waiting blocks would hold SMs its predecessor still needs (measured: PDL on every
    launch made a 32x48 forward 6% slower, on single-wave launches only it makes 1x48 7% faster)."""
    wait = gdc(device)
    return {"USE_GDC": wait, "launch_pdl": wait and programs <= sms(device)}


_SMS: dict[int, int] = {}


def sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 132                 # Triton's CPU interpreter (tests): any count will do
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]
