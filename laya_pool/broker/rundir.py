"""The supervisor's private directory (the default ipc backend lives there), and what a killed one left.

A supervisor killed with SIGKILL cannot remove its `laya-pool-XXXX` directory. Each one therefore records its
pid in `owner.pid`, and the next supervisor removes every directory of this user whose owner is no longer
running, before it makes its own. Directories without that file (a `local_pool`'s, say) are not touched.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("laya-pool.supervisor")
PREFIX = "laya-pool-"
OWNER = "owner.pid"


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True          # someone else's process holds that pid: not ours to judge
    return True


def clean_stale(base: str | os.PathLike | None = None) -> list[Path]:
    """Remove this user's supervisor directories whose owner is dead; returns what was removed."""
    removed = []
    root = Path(base or tempfile.gettempdir())
    for d in root.glob(PREFIX + "*"):
        with contextlib.suppress(OSError, ValueError):
            if not d.is_dir() or d.is_symlink() or d.stat().st_uid != os.getuid():
                continue
            pid = int((d / OWNER).read_text().strip())
            if pid == os.getpid() or _running(pid):
                continue
            shutil.rmtree(d)
            removed.append(d)
            log.info("removed %s, left by a supervisor (pid %d) that is no longer running", d, pid)
    return removed


def make_private() -> Path:
    """A fresh 0700 directory marked with this process's pid (after clearing what dead supervisors left)."""
    clean_stale()
    d = Path(tempfile.mkdtemp(prefix=PREFIX))
    os.chmod(d, 0o700)
    (d / OWNER).write_text(f"{os.getpid()}\n")
    return d
