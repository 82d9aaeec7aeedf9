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

_POOL_NAMES = ("Client", "AsyncClient")


def __getattr__(name: str) -> Any:
    # The ZeroMQ client lives in client.pool; loaded on first use so `import client` stays light.
    if name in _POOL_NAMES:
        from . import pool
        return getattr(pool, name)
    raise AttributeError(f"module 'client' has no attribute {name!r}")
