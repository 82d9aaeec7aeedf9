"""`predict_batch`'s bookkeeping: checking the states, packing whole states into requests, splitting replies.

Many states' rows travel together: each request carries the rows of as many whole states as fit the pool's
capacity (rows, tokens, option markers per request, from the model card) and the caller's `batch_size`
(states per request). A worker runs a request as one forward pass, as the SDK runs one `predict_batch`
chunk, and merges concurrent requests into shared passes itself, so fewer, fuller requests cost the least.
A state's rows are never split across requests (the reply to one request answers whole states).
No I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

MODEL_NAME = "laya-rl-agent"


def check_states(states: Any, questions: Any) -> list[Any]:
    """The states as a list, or the SDK's TypeError (same checks, same order, same words)."""
    if isinstance(states, (str, bytes, dict)):
        raise TypeError("predict_batch expects a list of states; pass a single state to predict()/system_one().")
    if not isinstance(questions, dict):
        raise TypeError(f"questions must be a dict of question id -> definition, got {type(questions).__name__}")
    states = list(states)
    if any(state is None for state in states):
        raise TypeError("state must not be None; pass a string, dict, or list")
    return states


def empty_result() -> dict[str, Any]:
    """What the SDK answers a state asked no questions: no tokenizing, no forward pass."""
    return {"model": MODEL_NAME, "answers": {}, "usage": {"input_tokens": 0, "output_tokens": 0}}


def pack(sizes: Sequence[tuple[int, int, int]], capacity: dict[str, int],
         batch_size: int | None = None) -> list[list[int]]:
    """Indices of whole states per request, in order: each request at most `batch_size` states and within
    `capacity` ("max_rows", "max_tokens", "max_markers"; a missing key is no limit). `sizes` is each
    state's (rows, tokens, markers); a state larger than the capacity alone gets a request of its own
    (the client refuses it before sending, naming the limit)."""
    if len(sizes) == 1:         # one state (every predict's): one request, without the loop below
        return [[0]]
    limits = (capacity.get("max_rows"), capacity.get("max_tokens"), capacity.get("max_markers"))
    per_request = batch_size if batch_size and batch_size > 0 else None
    chunks: list[list[int]] = []
    current: list[int] = []
    used = [0, 0, 0]
    for i, size in enumerate(sizes):
        fits = all(cap is None or used[k] + size[k] <= cap for k, cap in enumerate(limits))
        if current and (not fits or (per_request is not None and len(current) >= per_request)):
            chunks.append(current)
            current, used = [], [0, 0, 0]
        current.append(i)
        used = [u + s for u, s in zip(used, size)]
    if current:
        chunks.append(current)
    return chunks


def split_outputs(flat: np.ndarray, act: np.ndarray, markers: list[int],
                  rows: list[int]) -> list[tuple[np.ndarray, np.ndarray]]:
    """One request's logits (float32 [M], rows in order) and act probabilities [R, n_act] back per state,
    given each state's marker and row counts."""
    out = []
    m = r = 0
    for n_markers, n_rows in zip(markers, rows):
        out.append((flat[m:m + n_markers], act[r:r + n_rows]))
        m, r = m + n_markers, r + n_rows
    if m != flat.shape[0] or r != act.shape[0]:
        raise ValueError(f"split_outputs: {flat.shape[0]} logits and {act.shape[0]} act rows for states of "
                         f"{m} markers and {r} rows")
    return out
