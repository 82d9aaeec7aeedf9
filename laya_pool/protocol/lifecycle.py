"""A supervised process's life, the same under every supervisor of the pool (`up`'s and `laya-pool workers`'
children, broker/children.py; the gateway's processes, gateway/processes.py): the backoff before a process that
exited is started again, and its death with its supervisor.

The backoff: 0.5 s after the first exit, doubled per exit up to 30 s, back to 0.5 s once a process ran a minute.
"""
from __future__ import annotations

import contextlib
import ctypes
import signal

BACKOFF_START = 0.5
BACKOFF_MAX = 30.0
STABLE_AFTER = 60.0     # a process up this long has its backoff reset

try:  # loaded at import, in the parent: dlopen after fork, with zmq's threads about, can deadlock the child
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:
    _LIBC = None


def next_backoff(backoff: float) -> float:
    """The backoff after one more exit."""
    return min(BACKOFF_MAX, backoff * 2)


def backoff_after(backoff: float, up_s: float) -> float:
    """The backoff of a process that exited after `up_s` seconds up: reset if it ran long enough."""
    return BACKOFF_START if up_s >= STABLE_AFTER else backoff


def die_with_parent() -> bool:
    """Have this process get SIGTERM when its parent dies (Linux; elsewhere nothing); whether that was set."""
    if _LIBC is None:
        return False
    with contextlib.suppress(Exception):
        return _LIBC.prctl(1, signal.SIGTERM) == 0   # PR_SET_PDEATHSIG
    return False
