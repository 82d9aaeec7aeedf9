"""The facts the client, the broker, the worker and the supervisor must agree on, written once.

Execution modes, the reasons a reply or a departure carries, process exit codes, the
shared defaults and the model fingerprint. docs/protocol.md lists every reason, and
tests/test_contract.py checks that it does, so the document cannot fall behind the code.

Pure Python (os, enum, hashlib): importing it costs nothing, so every room may. The question types have their
own module, protocol/qtypes.py.
"""
from __future__ import annotations

import enum
import hashlib
import os
from pathlib import Path

from . import settings

# ---------------------------------------------------------------------------------------------- execution

MODES = ("eager", "graph-fixed", "graph-cached")


# ---------------------------------------------------------------------------------------------- reasons

class _Text(str, enum.Enum):
    # str() and f-strings give the wire text, not "Reason.BUSY": these values travel in headers and logs.
    def __str__(self) -> str:
        return str(self.value)


class Reason(_Text):
    """`error.reason` of a reply that is not "ok": why, in a word a program can branch on."""
    BUSY = "busy"                              # retryable: the broker's bounded queue is full (+ retry-after)
    NO_WORKER = "no-worker"                    # retryable: its deadline ran out queued, with no worker serving
    EXPIRED = "expired"                        # retryable: its deadline ran out before a worker started it
    QUEUE_TIMEOUT = "queue-timeout"            # retryable: no worker took it in time
    WORKER_UNAVAILABLE = "worker-unavailable"  # retryable: the targeted worker is not ready
    STOPPING = "stopping"                      # retryable: the worker is leaving; the broker runs it elsewhere
    BOUNCED = "bounced"                        # retryable: workers kept handing it back
    SHUTDOWN = "shutdown"                      # retryable: the broker is stopping
    STALE = "stale"                            # retryable: queued before the worker registered again
    UPLOAD_FAILED = "upload-failed"            # retryable: a copy to the device failed (drained; safe to go on)
    WORKER_FAULT = "worker-fault"              # retryable: the worker broke running it; counts as a lost attempt
    INTERNAL = "internal"                      # an internal error (retryable from the broker, final from a worker)
    WORKERS_LOST = "workers-lost"              # final: `max_attempts` workers were lost while holding it
    TOO_LARGE = "too-large"                    # final, raised by the client: a frame over the broker's limit
    NOT_ALLOWED = "not-allowed"                # final: an operator command without the operator credential
    RATE_LIMITED = "rate-limited"              # final: too many restarts in the window; the message says when
    TIMEOUT = "timeout"                        # raised by the client: no answer within the call's deadline
    UNREACHABLE = "unreachable"                # raised by the client: nothing answered at the endpoint


class Leave(_Text):
    """The `reason` of a DISCONNECT (and of a worker's own DRAIN): why a worker goes or must register again."""
    DRAIN = "drain"                  # worker -> broker: drained, stays down until restart-worker
    RESTART = "restart"              # worker -> broker: drained for a restart
    SHUTDOWN = "shutdown"            # worker -> broker: SIGTERM, work finished
    FATAL = "fatal"                  # worker -> broker: a fatal error; the supervisor replaces it
    HUNG = "hung"                    # broker -> worker: a request outlived --job-timeout; exit fatally
    NOT_REGISTERED = "not registered"  # broker -> worker: unknown to this broker; send READY again


class WorkerState(_Text):
    """A worker's state in the broker's table (`status` shows it; the supervisor and the CLI read it)."""
    READY = "ready"              # takes requests
    DRAINING = "draining"        # finishing what it holds; nothing more is dispatched to it
    RESTARTING = "restarting"    # left to be restarted (drained for restart-worker)
    DRAINED = "drained"          # left after a drain; stays down until restart-worker
    STOPPED = "stopped"          # left: shutdown or a fatal error
    DEAD = "dead"                # silent, unreachable, hung, or replaced by a new registration
    MISMATCH = "mismatch"        # serves another model than the pool: reached only by requests that name it

    @property
    def live(self) -> bool:
        """Registered and serving the pool's model: what it holds must be re-sent if it goes."""
        return self in (WorkerState.READY, WorkerState.DRAINING)

    @property
    def connected(self) -> bool:
        """Registered and heard from: heartbeats are exchanged and its messages are handled."""
        return self.live or self is WorkerState.MISMATCH

    @property
    def dispatchable(self) -> bool:
        """May be sent a request (a mismatched one only a request that names it)."""
        return self in (WorkerState.READY, WorkerState.MISMATCH)


# ---------------------------------------------------------------------------------------------- exit codes

# Worker process exit codes (the supervisor reads them; a dead worker never looks like a clean exit).
EXIT_OK = 0          # SIGTERM / drain: finished its in-flight work and left
EXIT_FATAL = 1       # crashed or hit a fatal device error: restart with backoff
EXIT_USAGE = 2       # bad command line
EXIT_RESTART = 75    # drained for `laya-pool restart-worker`: restart now
EXIT_CONFIG = 78     # the checkpoint or the configuration is unusable: restarting will not help

# ---------------------------------------------------------------------------------------------- defaults

FRONTEND_ENV = "LAYA_POOL_FRONTEND"
FRONTEND = "tcp://127.0.0.1:5555"
BACKEND = "tcp://127.0.0.1:5556"
HEARTBEAT_MS = 1000
LIVENESS = 3                          # heartbeats missed (either way) before the peer is taken for gone
MAX_FRONTEND_BYTES = 16 << 20         # the broker's frontend ZMQ_MAXMSGSIZE (per frame)
MAX_BACKEND_BYTES = 1 << 30           # the backend's (taps can be large)
CALL_TIMEOUT_S = 10.0                 # a client call's deadline: from the call to its answer or its error
CONNECT_TIMEOUT_S = 3.0               # a call with no connection to the pool this long reports it unreachable
# A "busy" reply's retry-after hint (the broker's queue depth over its recent drain rate) stays within these.
RETRY_AFTER_MIN_S = 0.05
RETRY_AFTER_MAX_S = 5.0


def default_frontend() -> str:
    """The endpoint clients and operator commands use when none is given: $LAYA_POOL_FRONTEND, or loopback."""
    return settings.raw(FRONTEND_ENV) or FRONTEND


# ---------------------------------------------------------------------------------------------- fingerprint

# The checkpoint files, in hashing order. A worker reports the fingerprint of what it loaded; the
# supervisor pins the broker to the same value computed from the directory; a client reading a card
# from a directory gets it too: one function, so the three can never disagree.
FINGERPRINT_FILES = ("rl_agent_config.json", "model.safetensors", "encoder/config.json",
                     "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json")


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 over the configs, the tokenizer and the weights: two workers agree iff they serve the same model.

    Raises OSError for a file that cannot be read (each caller turns it into its own error type)."""
    path = Path(path)
    h = hashlib.sha256()
    for rel in FINGERPRINT_FILES:
        h.update(rel.encode() + b"\0")
        with open(path / rel, "rb") as f:
            while chunk := f.read(1 << 22):
                h.update(chunk)
    return h.hexdigest()
