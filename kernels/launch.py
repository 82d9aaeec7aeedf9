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


def pdl(device: torch.device) -> bool:
    """Whether kernels on `device` are launched with programmatic dependent launch."""
    if device.type != "cuda" or os.environ.get("LAYA_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9
