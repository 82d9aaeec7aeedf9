"""Who may change the pool: the operator credential and the restart rate limit.

Operator commands (drain, restart-worker: anything that changes the pool) travel on the same frontend as
clients' requests, so reaching the frontend must not be enough to run them. A DRAIN is accepted from a
peer that presents one of:

- on any endpoint, the pool's operator secret in the header (`op`): 32 random bytes the broker writes,
  after it has bound its sockets, to a file only its user can read (`secret_path(frontend)`, mode 0600 in a
  0700 directory; protocol/credentials.py). `laya-pool drain / restart-worker` read it, whichever spelling of the
  frontend's host they are given; a plain `Client` does not have it.
- under CURVE, the operator key (`operator.key_secret`; its public half in `authorized-operators/`): the
  broker reads the authenticated key of the connection (ZeroMQ's `User-Id` metadata), so a client key,
  which only reaches `authorized/`, cannot drain a worker even if it can read the wire.

Restarts are rate-limited (`RestartLimit`) whoever asks: a flood of restart-worker commands cannot keep
the pool's workers reloading their models.

Imported by the broker and the CLI only (the client receives the secret as a string).
"""
from __future__ import annotations

import collections
import contextlib
import os
from pathlib import Path

from laya_pool.protocol import credentials

SECRET_ENV = "LAYA_POOL_RUNTIME_DIR"


def runtime_dir() -> Path:
    """Where operator secrets live (protocol/credentials.py): $LAYA_POOL_RUNTIME_DIR, else
    $XDG_RUNTIME_DIR/laya-pool, else ~/.cache/laya-pool/run."""
    return credentials.runtime_dir()


def secret_path(frontend: str) -> Path:
    """The operator secret of the pool on `frontend` (one file per endpoint, however its host is spelt)."""
    return credentials.secret_path(credentials.OPERATOR, frontend)


def publish_secret(frontend: str) -> tuple[str, Path]:
    """A fresh secret, written atomically (0600) where `read_secret(frontend)` finds it: (secret, path)."""
    return credentials.publish(credentials.OPERATOR, frontend)


def read_secret(frontend: str) -> str | None:
    """The operator secret for `frontend`, or None when this user has none (not the pool's operator)."""
    return credentials.read(credentials.OPERATOR, frontend)


def remove_secret(path: Path, token: str) -> None:
    """Remove `path` if it still holds `token` (a newer broker on the same endpoint may have replaced it)."""
    credentials.remove(path, token)


def token_matches(given: object, token: str | None) -> bool:
    return credentials.matches(given, token)


def operator_keys(keys: str | os.PathLike | None) -> set[str]:
    """The z85 public keys in `keys/authorized-operators/` (ZeroMQ's User-Id of a CURVE peer is its z85 key)."""
    if not keys:
        return set()
    import zmq.auth

    out = set()
    folder = Path(keys) / "authorized-operators"
    for f in sorted(folder.glob("*.key")) if folder.is_dir() else []:
        with contextlib.suppress(Exception):
            public, _ = zmq.auth.load_certificate(str(f))
            out.add(public.decode("ascii"))
    return out


class RestartLimit:
    """At most `limit` restarts per sliding `window_s` seconds, for the whole pool."""

    def __init__(self, limit: int, window_s: float):
        self.limit, self.window_s = limit, window_s
        self.times: collections.deque[float] = collections.deque()

    def allow(self, now: float) -> float:
        """0.0 and the restart counted, or the seconds until the next one will be allowed."""
        while self.times and now - self.times[0] >= self.window_s:
            self.times.popleft()
        if len(self.times) >= self.limit:
            return self.window_s - (now - self.times[0])
        self.times.append(now)
        return 0.0
