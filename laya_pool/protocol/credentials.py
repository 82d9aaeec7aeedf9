"""The pool's secrets on disk: the operator secret (broker/operator.py) and the worker secret, each a file of 32
random bytes only the pool's user can read, in the run directory.

Who reads the run directory is trusted with the pool: the broker writes both secrets there after it has bound its
sockets; `laya-pool drain / restart-worker / reload` read the operator secret (a DRAIN carries it), a worker reads
the worker secret and proves with it that the pool started it (READY's `proof`: an HMAC of its socket identity, so
the secret itself never travels). A process that does not read the directory (a client, another pool's worker,
another user's process) has neither. A worker of the same user under another run directory (`laya-pool workers`
with another LAYA_POOL_RUNTIME_DIR) is given the path of its broker's worker secret (`--worker-secret-file`), read
at each registration as the run directory's is. With CURVE keys the worker key is the proof and none is asked: a
tcp backend, and so a worker on another host, needs keys (or `--insecure-backend`, which asks for no proof), so the
worker secret only ever serves workers on the broker's own host.

One file per endpoint, named by a digest of the endpoint in one spelling (`canonical`): a loopback or wildcard tcp
host is `local` (tcp://localhost:5555, tcp://127.0.0.1:5555 and tcp://[::1]:5555 are one pool's frontend), an ipc
path is absolute. Imported by the broker, the workers and the CLI (the client receives the operator secret as a
string).
"""
from __future__ import annotations

import contextlib
import hashlib
import hmac
import ipaddress
import os
import secrets
import tempfile
from pathlib import Path

from . import settings

OPERATOR, WORKER = "operator", "worker"
_WILDCARD = ("*", "0.0.0.0", "::", "")


def runtime_dir() -> Path:
    """Where the secrets live: $LAYA_POOL_RUNTIME_DIR, else $XDG_RUNTIME_DIR/laya-pool, else ~/.cache/laya-pool/run.
    Per user: another user cannot read (or plant) a secret there."""
    if settings.get("LAYA_POOL_RUNTIME_DIR"):
        return Path(settings.get("LAYA_POOL_RUNTIME_DIR"))
    if settings.get("XDG_RUNTIME_DIR"):
        return Path(settings.get("XDG_RUNTIME_DIR")) / "laya-pool"
    return Path.home() / ".cache" / "laya-pool" / "run"


def canonical(endpoint: str) -> str:
    """`endpoint` in one spelling per place: a loopback or wildcard tcp host is `local`, an ipc path absolute."""
    if endpoint.startswith("ipc://"):
        return "ipc://" + os.path.abspath(endpoint[len("ipc://"):])
    if not endpoint.startswith("tcp://") or ";" in endpoint:
        return endpoint
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    bare = host.strip("[]")
    if bare == "localhost" or bare in _WILDCARD:
        return f"tcp://local:{port}"
    try:
        if ipaddress.ip_address(bare).is_loopback:
            return f"tcp://local:{port}"
    except ValueError:
        pass
    return endpoint


def secret_path(kind: str, endpoint: str) -> Path:
    """The `kind` secret (OPERATOR or WORKER) of the pool on `endpoint` (its frontend, or its backend)."""
    return runtime_dir() / _name(kind, canonical(endpoint))


def _name(kind: str, endpoint: str) -> str:
    return f"{kind}-{hashlib.sha256(endpoint.encode()).hexdigest()[:20]}"


def _private_dir(d: Path) -> None:
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    st = d.stat()
    if st.st_uid != os.getuid():
        raise PermissionError(f"{d}: owned by uid {st.st_uid}, not by this user; refusing to keep secrets there")
    if st.st_mode & 0o077:
        os.chmod(d, 0o700)


def publish(kind: str, endpoint: str) -> tuple[str, Path]:
    """A fresh secret, written atomically (0600) where `read(kind, endpoint)` finds it: (secret, path)."""
    path = secret_path(kind, endpoint)
    _private_dir(path.parent)
    token = secrets.token_hex(32)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".secret-")      # mkstemp: 0600, never follows a link
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)
    return token, path


def read(kind: str, endpoint: str) -> str | None:
    """The `kind` secret of the pool on `endpoint`, or None when this user has none. A file named by the exact
    spelling (what a broker before `canonical` wrote) is read when the canonical one is missing."""
    for path in (secret_path(kind, endpoint), runtime_dir() / _name(kind, endpoint)):
        if token := read_file(path):
            return token
    return None


def read_file(path: str | os.PathLike) -> str | None:
    """The secret the file `path` holds, or None when it cannot be read or is empty."""
    try:
        return Path(path).read_text().strip() or None
    except OSError:
        return None


def worker_secret(backend: str, path: str | None = None) -> str | None:
    """The worker secret a worker of the pool on `backend` proves itself with: the file `path` (`--worker-secret-file`:
    a worker under another run directory is given the broker's file), else the one its broker wrote to this user's
    run directory."""
    return read_file(path) if path else read(WORKER, backend)


def remove(path: Path, token: str) -> None:
    """Remove `path` if it still holds `token` (a newer broker on the same endpoint may have replaced it)."""
    with contextlib.suppress(OSError):
        if path.read_text().strip() == token:
            path.unlink()


def matches(given: object, token: str | None) -> bool:
    return isinstance(given, str) and token is not None and hmac.compare_digest(given.encode(), token.encode())


def proof(token: str, identity: bytes) -> str:
    """What a worker's READY carries as `proof`: HMAC-SHA256 of its socket identity under the worker secret."""
    return hmac.new(token.encode(), b"laya-pool worker " + identity, hashlib.sha256).hexdigest()


def proves(given: object, token: str | None, identity: bytes) -> bool:
    """Whether `given` is the proof of `identity` under `token`."""
    return token is not None and matches(given, proof(token, identity))
