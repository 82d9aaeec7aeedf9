"""Where a worker runs: the device torch sees and the CPUs the process is pinned to.

Apart from the serving code because it is about the machine, not the protocol: the supervisor sets
CUDA_VISIBLE_DEVICES to one GPU, and the worker pins itself to the CPUs on that GPU's PCI bus, so host
work (validation, packing, the I/O thread) runs next to the device it feeds.
"""
from __future__ import annotations

import logging
import os

from laya_pool.protocol import settings

log = logging.getLogger("laya-pool.worker")


def cuda_local_device(device: str) -> tuple[str, str]:
    """(device for torch, label for the pool). The supervisor sets CUDA_VISIBLE_DEVICES to the one GPU."""
    if not device.startswith("cuda"):
        return device, device
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v.strip() for v in (settings.get("CUDA_VISIBLE_DEVICES") or "").split(",") if v.strip()]
    if visible:
        if str(index) in visible:
            return f"cuda:{visible.index(str(index))}", f"cuda:{index}"
        if len(visible) == 1:
            return "cuda:0", f"cuda:{index}"
    return f"cuda:{index}", f"cuda:{index}"


def parse_cpus(spec: str) -> list[int]:
    """`"0-3,8"` -> [0, 1, 2, 3, 8]."""
    out: list[int] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            out.extend(range(int(a), int(b) + 1))
        else:
            out.append(int(part))
    return out


def numa_cpus(torch_device: str) -> list[int] | None:
    """The CPUs local to the GPU's PCI bus (from sysfs), best effort."""
    try:
        import torch
        props = torch.cuda.get_device_properties(torch.device(torch_device))
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/local_cpulist") as f:
            return parse_cpus(f.read().strip())
    except Exception:  # noqa: BLE001 - no sysfs, no props: leave the affinity alone
        return None


def pin(cpus: list[int] | None) -> list[int] | None:
    """Pin this process to `cpus` (those it may use); the CPUs it got, or None where it was left alone."""
    if not cpus:
        return None
    try:
        import psutil
        allowed = set(psutil.Process().cpu_affinity())
        cpus = [c for c in cpus if c in allowed] or sorted(allowed)
        psutil.Process().cpu_affinity(cpus)
        return cpus
    except Exception as e:  # noqa: BLE001 - affinity is an optimisation
        log.warning("cannot set CPU affinity %s: %s", cpus, e)
        return None


def pin_thread(cpu: int) -> bool:
    """Pin the calling thread (alone: Linux's affinity is per thread; threads it starts later inherit it) to `cpu`;
    whether it took."""
    try:
        os.sched_setaffinity(0, {cpu})
        return True
    except (OSError, AttributeError) as e:
        log.warning("cannot pin the thread to CPU %d: %s", cpu, e)
        return False
