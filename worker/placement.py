"""Where a worker runs: the device torch sees and the CPUs the process is pinned to.

Apart from the serving code because it is about the machine, not the protocol: the supervisor sets
CUDA_VISIBLE_DEVICES to one GPU, and the worker pins itself to the CPUs on that GPU's PCI bus, so host
work (validation, packing, the I/O thread) runs next to the device it feeds.
"""
from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger("laya-pool.worker")


def cuda_local_device(device: str) -> tuple[str, str]:
    """(device for torch, label for the pool). The supervisor sets CUDA_VISIBLE_DEVICES to the one GPU."""
    if not device.startswith("cuda"):
        return device, device
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
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


# How fast each CPU runs Python now. The device hosts' vCPUs run a fixed loop at two speeds ~1.8x apart, changing every
# 10-40 ms, each CPU fast between 4% and 54% of a 20 s window and steady in that share (scripts/cpu_speed.py --phases,
# docs/PERF.md, thirty-sixth session): a core shared with a tenant outside the VM. The data thread launches every
# group and answers every request, so the CPU it spins on is the one worth choosing.
_LOOP = """import os, sys, time
os.sched_setaffinity(0, {int(sys.argv[1])})
t0 = time.perf_counter(); end = t0 + float(sys.argv[2]); n = 0; x = 0
while time.perf_counter() < end:
    for i in range(2000):
        x = (x + i) & 0xFFFF
    n += 1
print((time.perf_counter() - t0) / max(n, 1) * 1e6)
"""


def cpu_speeds(cpus: list[int], seconds: float = 0.5) -> dict[int, float]:
    """Microseconds a fixed loop took on each CPU, all timed at once over the same `seconds` (one fresh interpreter
    per CPU: no fork of a process that holds a CUDA context); CPUs whose timing failed are left out."""
    procs = {c: subprocess.Popen([sys.executable, "-c", _LOOP, str(c), str(seconds)], stdout=subprocess.PIPE,
                                 stderr=subprocess.DEVNULL, text=True) for c in cpus}
    out: dict[int, float] = {}
    for c, p in procs.items():
        try:
            text, _ = p.communicate(timeout=seconds + 10)
            out[c] = float(text)
        except (subprocess.TimeoutExpired, ValueError):
            p.kill()
    return out


def quickest(speeds: dict[int, float]) -> int | None:
    """The CPU whose loop took least (the lower number on a tie); None without any."""
    return min(speeds, key=lambda c: (speeds[c], c)) if speeds else None


def pin_thread(cpu: int) -> bool:
    """Pin the calling thread (alone: Linux's affinity is per thread) to `cpu`; whether it took."""
    try:
        os.sched_setaffinity(0, {cpu})
        return True
    except (OSError, AttributeError) as e:
        log.warning("cannot pin the thread to CPU %d: %s", cpu, e)
        return False
