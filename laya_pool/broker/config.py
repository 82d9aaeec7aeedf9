"""The broker's settings (`laya-pool broker`, `laya-pool up` and `python -m laya_pool.broker.broker` set them from
their flags: broker/broker.py `POLICY_FLAGS`)."""
from __future__ import annotations

from dataclasses import dataclass

from laya_pool.protocol import contract


@dataclass
class BrokerConfig:
    frontend: str = contract.FRONTEND
    backend: str = contract.BACKEND
    heartbeat_ms: int = contract.HEARTBEAT_MS
    liveness: int = contract.LIVENESS
    queue_size: int = 1024
    queue_timeout_s: float = 30.0
    max_attempts: int = 3               # workers a request may be lost on before it is failed
    max_bounces: int = 32               # "worker stopping" hand-backs before the client is told to retry
    job_timeout_s: float = 300.0        # a worker holding one request longer than this is declared hung
    fingerprint: str | None = None      # the model this pool serves; None: the first worker's
    cache_size: int = 4096              # finished replies kept for retries
    cache_max_bytes: int = 256 << 20    # ... and the bytes they may hold together
    queue_max_bytes: int = 1 << 30      # request payloads waiting or running, together
    cache_ttl_s: float = 300.0
    cache_max_reply_bytes: int = 1 << 20
    max_frontend_bytes: int = contract.MAX_FRONTEND_BYTES  # ZMQ_MAXMSGSIZE (per frame): a larger one drops the client
    max_backend_bytes: int = contract.MAX_BACKEND_BYTES
    keys: str | None = None             # CURVE key directory (laya-pool keys); needed for a non-loopback bind
    insecure_backend: bool = False      # a tcp backend without keys (development only; logged)
    operator_secret: bool = True        # publish the operator secret (broker.operator) once bound
    worker_secret: bool = True          # ... and the worker secret, and refuse a READY without its proof (but with
                                        # keys, whose worker key is the proof, or insecure_backend)
    max_restarts: int = 6               # restart-worker commands accepted per restart_window_s, pool-wide
    restart_window_s: float = 60.0
    client_hwm: int = 1000              # replies queued per client before more are dropped (it is not reading)
    unread_max_bytes: int = 64 << 20    # bytes of replies not yet taken by their clients, all clients together
    poll_us: int = 0                    # after a message, poll without sleeping this long (0: always sleep)
    http: str | None = None             # `laya-pool broker --http`: [HOST:]PORT for /metrics and /health; None: off
