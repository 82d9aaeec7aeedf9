"""laya-pool: a multi-process GPU worker pool serving Laya decision models, and its client.

    from laya_pool import Client, AsyncClient, local_pool

Everything a decision loop needs is importable from here: the clients, `local_pool`, the model card and every
error a pool call raises. The names are loaded on first use, so `import laya_pool` costs nothing and a broker
or worker process (which imports this package as its parent) loads no client code it does not use.

Layout: the rooms (protocol, client, kernels, worker, broker, gateway, tools) are this package's subpackages;
`client` and `kernels` depend on nothing of ours but `protocol`, `worker` uses `kernels` and `protocol`, `broker` uses
`protocol`, the HTTP `gateway` uses `client` and `protocol`, and `tools` may use every room.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> the module under this package that defines it
_EXPORTS = {
    "Client": "client.pool", "AsyncClient": "client.pool_async",
    "local_pool": "client.local", "LocalPool": "client.local",
    "RetryPolicy": "client.retry", "ModelCard": "client.card",
    # every error a pool call raises is a PoolError; each also keeps the type a caller may already catch
    "PoolError": "client.errors", "RequestFailed": "client.errors", "PoolUnavailable": "client.errors",
    "MalformedReply": "client.errors", "BadModelCard": "client.errors", "PoolBusy": "client.errors",
    "PoolNoWorker": "client.errors", "PoolTimeout": "client.errors", "PoolUnreachable": "client.errors",
    "SchemaError": "client.structured", "DecisionResult": "client.structured",
    "CardError": "client.card", "QuestionError": "client.semantics", "ProtocolError": "protocol.wire",
}
__all__ = [
    "AsyncClient", "BadModelCard", "CardError", "Client", "DecisionResult", "LocalPool", "MalformedReply", "ModelCard",
    "PoolBusy", "PoolError", "PoolNoWorker", "PoolTimeout", "PoolUnavailable", "PoolUnreachable", "ProtocolError",
    "QuestionError", "RequestFailed", "RetryPolicy", "SchemaError", "local_pool",
]

if TYPE_CHECKING:       # what type checkers see (py.typed); at run time __getattr__ loads the same names
    from .client.card import CardError, ModelCard
    from .client.errors import (
        BadModelCard,
        MalformedReply,
        PoolBusy,
        PoolError,
        PoolNoWorker,
        PoolTimeout,
        PoolUnavailable,
        PoolUnreachable,
        RequestFailed,
    )
    from .client.local import LocalPool, local_pool
    from .client.pool import Client
    from .client.pool_async import AsyncClient
    from .client.retry import RetryPolicy
    from .client.semantics import QuestionError
    from .client.structured import DecisionResult, SchemaError
    from .protocol.wire import ProtocolError


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
