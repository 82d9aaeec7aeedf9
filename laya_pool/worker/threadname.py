"""A worker thread's name in the OS as well as in Python.

Per-thread CPU (`top -H`, tools/cpu.py under load) then tells the I/O, compute and landing threads apart: at
saturation the busiest thread of a Python process is what limits it (one GIL), and knowing which one it is says
where to cut. Linux only (/proc/self/task/<tid>/comm, 15 bytes); elsewhere a no-op.
"""
from __future__ import annotations

import threading


def name_os_thread(name: str) -> None:
    """Give the calling thread `name` in the OS (truncated to 15 bytes)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
            f.write(name.encode()[:15].decode(errors="ignore"))
    except OSError:
        pass
