"""A worker's word to the supervisor on its host: whether the broker has it (`laya-pool workers --http`).

`laya-pool up` learns its workers' states from its broker's status. `laya-pool workers` supervises this host's workers
for a broker on another host, which it does not ask (it holds no client key, and a host's health must not hang on
another host's), so each worker it starts writes where it stands to a file in the supervisor's private directory
(`--presence-file`), replaced whole at each change, never on the request path:

- `connecting`: READY sent, the broker has not answered it yet (starting, or the broker is away);
- `registered`: the broker answered the READY (its first heartbeat): requests may come;
- `draining`: finishing what it holds before it leaves.

The file holds the writer's pid, so a supervisor never takes a dead process's last word for its successor's.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

CONNECTING = "connecting"
REGISTERED = "registered"
DRAINING = "draining"
STATES = (CONNECTING, REGISTERED, DRAINING)


def write(path: str | os.PathLike, state: str, pid: int) -> None:
    """Replace the file at `path` with `state` and `pid` (a reader sees the old file or the new one, never half)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{pid}")
    tmp.write_text(json.dumps({"state": state, "pid": pid}), encoding="utf-8")
    os.replace(tmp, path)


def read(path: str | os.PathLike, pid: int | None) -> str | None:
    """The state process `pid` last wrote at `path`, or None (no file, another process's, unreadable)."""
    try:
        said = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(said, dict) or said.get("pid") != pid or said.get("state") not in STATES:
        return None
    return said["state"]
