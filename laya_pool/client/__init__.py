"""The laya-pool client: request semantics (the SDK's token rows), answer decoding and the pool client.

Importing this package pulls in neither torch nor transformers; a decision loop embeds it.
"""
from __future__ import annotations

from typing import Any

from .card import CardError, ModelCard, clamp_temperature
from .decode import decode_answers, temp_bucket
from .semantics import EncodedRequest, QuestionError, check_question, encode_request, to_internal
from .structured import DecisionResult, SchemaError

__all__ = [
    "CardError", "ModelCard", "clamp_temperature",
    "EncodedRequest", "QuestionError", "check_question", "encode_request", "to_internal",
    "decode_answers", "temp_bucket", "DecisionResult", "SchemaError",
    "Client", "AsyncClient",
]

_POOL_NAMES = {"Client": "pool", "AsyncClient": "pool_async"}


def __getattr__(name: str) -> Any:
    # The ZeroMQ clients live in client.pool and client.pool_async; loaded on first use so `import client` stays light.
    if name in _POOL_NAMES:
        import importlib
        return getattr(importlib.import_module(f"{__name__}.{_POOL_NAMES[name]}"), name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
