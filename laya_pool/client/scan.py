"""`predict_long`'s arithmetic: windows over a long state, and one answer per question from the windows' answers.

A state longer than one row is tokenized once, cut into overlapping token windows, each window is decoded
back to text and scored as an ordinary state (every window one state of a `predict_batch`), and each
question takes the answer of its deciding window, the one its type's `window_score` (protocol/qtypes.py)
rates highest:

- noul: the window with the highest P(true) (the statement holds if any window supports it);
- choice and score: the window with the highest `answer_confidence` (a localized signal is not out-voted
  by the neutral windows a long document is mostly made of).

Every rule here is the SDK's (laya 0.4.15 `laya.common.state_room` / `window_budget` / `window_batch_cap`
and `Agent.predict_long`), warnings included; tests/test_client_sdk_api.py holds it to the installed SDK.
No I/O: the client feeds these the card, the state's ids and the windows' answers.
"""
from __future__ import annotations

import warnings
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES

from .card import ModelCard
from .semantics import build_head

# How far the default window may be cut before the caller is warned (the scan then costs that many
# times more forward passes than `max_len` suggests), and how much that cut may multiply the window
# count before one request of windows is capped (see `window_batch_cap`).
_WINDOW_CLAMP_WARN_RATIO = 2
_WINDOW_BATCH_BLOWUP = 2


def state_room(card: ModelCard, q: dict[str, Any], max_len: int, head_max_len: int) -> int:
    """State tokens question `q` (internal form) leaves in a row of `max_len`."""
    head, _, _ = build_head(card, q, head_max_len)
    return max(0, max_len - len(head) - 1)          # -1: the [SEP] closing the state


def default_window(max_len: int, head_max_len: int) -> int:
    """The state budget the config leaves, with a 64-token floor."""
    return max(64, max_len - head_max_len - 8)


def window_budget(card: ModelCard, questions: list[dict[str, Any]], max_len: int, head_max_len: int,
                  window: int | None = None, stride: int | None = None) -> tuple[int, int, int]:
    """(window, stride, room): the window capped at the smallest room the questions leave (one list of
    windows is scored for every question), the stride defaulting to half of it.

    ValueError when the options leave no room for the state, or a stride would skip tokens."""
    rooms = [state_room(card, q, max_len, head_max_len) for q in questions]
    asked = bool(window and window > 0)
    requested = window if asked else default_window(max_len, head_max_len)
    size = requested
    room = min(rooms) if rooms else size
    if room <= 0:
        raise ValueError(
            f"predict_long: the questions' options fill the whole sequence (max_len={max_len}, "
            f"head_max_len={head_max_len}), leaving no room for the state; no window can carry any of it. "
            "A label set this large is what laya.shortlist.predict_shortlist is for")
    if size > room:
        if asked:
            warnings.warn(
                f"laya: predict_long: window={size} is wider than the {room} state tokens these questions leave "
                f"inside max_len={max_len}, so every window would be truncated to {room} on the way to the "
                f"model; scanning with window={room} instead", RuntimeWarning, stacklevel=3)
        elif size >= room * _WINDOW_CLAMP_WARN_RATIO:
            warnings.warn(
                f"laya: predict_long: these questions leave only {room} of max_len={max_len} for the state "
                f"(their heads take the rest), so the scan window is capped {size} -> {room} and roughly "
                f"{size / room:.1f}x as many windows -- each a full forward pass -- are needed to read the "
                "document. Fewer or shorter options, a larger max_len, or laya.shortlist.predict_shortlist for "
                "a large label set will all cost less than scanning at this width", RuntimeWarning, stacklevel=3)
        size = room
    step = stride if (stride and stride > 0) else max(1, size // 2)
    if step > size:
        if size < requested and stride and stride <= requested:
            # The caller's stride fitted the window they asked for; the cut to the room is ours, so is this one.
            warnings.warn(
                f"laya: predict_long: stride={step} was a 50% step for the window={requested} you asked for, but "
                f"the window was reduced to {size} to fit the room these questions leave; scanning with "
                f"stride={max(1, size // 2)} instead", RuntimeWarning, stacklevel=3)
            step = max(1, size // 2)
        else:
            where = " these questions leave room for" if size < requested else ""
            raise ValueError(
                f"predict_long: stride={step} steps past the {size}-token window{where}, so {step - size} tokens "
                f"between every pair of windows would be read by no window at all; pass stride <= {size}")
    return size, step, room


def window_starts(n_tokens: int, window: int, stride: int) -> list[int]:
    """Token offsets of the windows: every `stride` tokens, the last one reaching the end."""
    starts, i = [], 0
    while i < n_tokens:
        starts.append(i)
        if i + window >= n_tokens:
            break
        i += stride
    return starts


def window_batch_cap(n_windows: int, window: int, config_budget: int, batch_size: int | None = None) -> int | None:
    """Windows per request: the caller's `batch_size`; else all of them, unless capping the window
    multiplied their count past `_WINDOW_BATCH_BLOWUP`, then what the un-capped scan would have sent."""
    if batch_size and batch_size > 0:
        return batch_size
    if window >= config_budget:
        return None
    unclamped = max(1, -(-n_windows * max(1, window // 2) // max(1, config_budget // 2)))
    if n_windows <= unclamped * _WINDOW_BATCH_BLOWUP:
        return None
    return unclamped


def _merge_usage(results: list[dict[str, Any]]) -> dict[str, Any]:
    # Numbers are summed (bools too: `truncated` becomes the count of cut windows), per-question maps
    # merged, anything else is the last window's: exactly the SDK's fold.
    usage: dict[str, Any] = {}
    for r in results:
        for key, val in r["usage"].items():
            prev = usage.get(key)
            if isinstance(val, (int, float)):
                usage[key] = (prev if isinstance(prev, (int, float)) else 0) + val
            elif isinstance(val, dict) and isinstance(prev, dict):
                usage[key] = {**prev, **val}
            else:
                usage[key] = val
    usage["output_tokens"] = 0
    usage["windows"] = len(results)
    return usage


def aggregate_windows(results: list[dict[str, Any]], qtypes: dict[Any, str], starts: list[int], window: int,
                      n_tokens: int) -> dict[str, Any]:
    """One `predict` result from the windows' results: each question's deciding window's answer, with
    `answer["window"]` naming it, and the windows' usage folded together."""
    if len(results) != len(starts):
        raise ValueError(f"predict_long: the state was split into {len(starts)} windows and the call returned "
                         f"{len(results)} results")
    answers: dict[Any, Any] = {}
    for qid, qtype in qtypes.items():
        per = [r["answers"][qid] for r in results]
        score = QUESTION_TYPES.by_name(qtype).window_score
        best = max(range(len(per)), key=lambda j: score(per[j]))
        ans = per[best]
        ans["window"] = {"index": best, "token_start": starts[best],
                         "token_end": min(starts[best] + window, n_tokens), "count": len(results)}
        answers[qid] = ans
    return {"model": "laya-rl-agent", "answers": answers, "usage": _merge_usage(results)}
