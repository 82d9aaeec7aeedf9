"""What the gateway refuses before a request reaches the pool: `laya serve` 0.4.15's bounds and checks, with its
status codes and detail texts, so a client written for it reads the same refusals.

The bounds (unauthenticated remote input; each is the SDK server's):
- a body of at most MAX_BODY_BYTES (2 MiB), however it is framed (Content-Length or chunked): 413;
- at most MAX_QUESTIONS (64) questions, MAX_CHOICE_OPTIONS (100) options a choice, MAX_SCORE_LEVELS (32) levels a
  score (each type's bound is its `served` part in protocol/qtypes.py), MAX_TOTAL_OPTIONS (512) options in all,
  MAX_STATE_CHARS (50,000) characters of serialized state, and MAX_BATCH_STATES (64) states a batch: 413;
- `max_len` / `head_max_len` at most MAX_TOKEN_BUDGET (8,192): 422.

Pure: every check raises a `Refusal` (status, detail, headers), which the app turns into `{"detail": ...}` as FastAPI
does its HTTPException.
"""
from __future__ import annotations

import json
import re
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES

MAX_QUESTIONS = 64
MAX_STATE_CHARS = 50000
MAX_BATCH_STATES = 64
MAX_BODY_BYTES = 2 * 1024 * 1024
MAX_CHOICE_OPTIONS = QUESTION_TYPES.by_name("choice").served.max_options
MAX_SCORE_LEVELS = QUESTION_TYPES.by_name("score").served.max_options
MAX_TOTAL_OPTIONS = 512
MAX_TOKEN_BUDGET = 8192

# The controls a body may not carry: hooks run inside the server process, and the two knobs govern the operator's.
BODY_REFUSALS = ("hooks", "on_predict_start", "on_predict_end", "hooks_raise", "hooks_timeout")
BATCH_OUT_PARAMETERS = ("diagnostics",)      # filled in place for an in-process caller: nothing to return over HTTP

BUSY = "server busy, try again later"
LONE_SURROGATE = "request body contains an unpaired surrogate escape; those cannot be encoded as UTF-8"
_SURROGATE = re.compile("[\ud800-\udfff]")
_PROBE_VALUES = 64           # values the state-length lower bound looks at before handing over to json.dumps


class Refusal(Exception):
    """An HTTP error answer: `{"detail": detail}` with `status` and `headers`."""

    def __init__(self, status: int, detail: str, headers: dict[str, str] | None = None):
        super().__init__(detail)
        self.status, self.detail, self.headers = status, detail, headers


def busy() -> Refusal:
    return Refusal(503, BUSY, {"Retry-After": "1"})


def parse_json(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except (ValueError, RecursionError):
        raise Refusal(400, "request body must be valid JSON") from None


def declared_too_large(content_length: str | None) -> bool:
    """Whether a Content-Length header already says the body is over the cap (an unreadable one says nothing)."""
    try:
        return bool(content_length) and int(content_length) > MAX_BODY_BYTES
    except ValueError:
        return False


def _state_length_over(state: Any, cap: int) -> int:
    """A lower bound on the serialized length of `state` when it already proves the length is over `cap`, else 0 (the
    SDK's: the raw lengths of its strings, looking at no more than _PROBE_VALUES values; exact types only)."""
    total, budget, stack = 0, _PROBE_VALUES, [state]
    while stack and budget > 0:
        budget -= 1
        item = stack.pop()
        if isinstance(item, str):
            total += len(item)
            if total > cap:
                return total
        elif type(item) is dict:
            stack.extend(item.values())
        elif type(item) is list or type(item) is tuple:
            stack.extend(item)
        else:
            return 0
    return 0


def state_length(state: Any) -> int:
    """The length of the state text that is tokenized (the state itself, or its JSON), as the 413 reports it."""
    if isinstance(state, str):
        return len(state)
    over = _state_length_over(state, MAX_STATE_CHARS)
    if over:
        return over
    try:
        return len(json.dumps(state, ensure_ascii=False))
    except (TypeError, ValueError, RecursionError):
        raise Refusal(400, "'state' must be JSON-serializable") from None


def _check_question_sizes(questions: dict[Any, Any]) -> None:
    total = 0
    for qid, question in questions.items():
        qtype = QUESTION_TYPES.find(question.get("type")) if isinstance(question, dict) else None
        if qtype is None or qtype.served.count is None:
            continue
        served, crit = qtype.served, question.get("criteria")
        count = served.count(crit)
        if count is None:
            continue
        total += count
        if count > served.max_options:
            raise Refusal(413, f"too many {served.options_word} for {qid!r} ({count} > {served.max_options})")
        if served.null_refusal is not None and None in crit:
            raise Refusal(422, served.null_refusal.format(qid=qid, index=crit.index(None)))
    if total > MAX_TOTAL_OPTIONS:
        raise Refusal(413, f"too many answer options across questions ({total} > {MAX_TOTAL_OPTIONS})")


def check_request(state: Any, questions: Any) -> None:
    """One state and its questions: present, and within the bounds (400 / 413 / 422)."""
    if state is None:
        raise Refusal(400, "'state' is required")
    if not isinstance(questions, dict):
        raise Refusal(400, "'questions' must be an object")
    if len(questions) > MAX_QUESTIONS:
        raise Refusal(413, f"too many questions ({len(questions)} > {MAX_QUESTIONS})")
    _check_question_sizes(questions)
    length = state_length(state)
    if length > MAX_STATE_CHARS:
        raise Refusal(413, f"state too large ({length} > {MAX_STATE_CHARS} chars)")


def check_batch(states: Any, questions: Any) -> None:
    if not isinstance(states, list) or len(states) == 0:
        raise Refusal(400, "'states' must be a non-empty list")
    if len(states) > MAX_BATCH_STATES:
        raise Refusal(413, f"too many states in batch ({len(states)} > {MAX_BATCH_STATES})")
    for state in states:
        check_request(state, questions)


def refuse_controls(body: dict[str, Any], batch: bool = False) -> None:
    """A body that sends a control the server cannot honour is told so (422), not ignored."""
    given = sorted(k for k in BODY_REFUSALS if body.get(k) is not None)
    if given:
        raise Refusal(422, f"{', '.join(given)} run inside the server process and cannot be sent to this endpoint; "
                           "install them where laya-serve runs, or drop them")
    given = sorted(k for k in BATCH_OUT_PARAMETERS if body.get(k) is not None) if batch else []
    if given:
        raise Refusal(422, f"{', '.join(given)} is filled in place for an in-process caller and cannot be returned "
                           "over HTTP; read the per-group report from the CLI or a local Router")


def has_lone_surrogate(value: Any) -> bool:
    """Whether any string (key or value) holds an unpaired surrogate, which cannot be encoded as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return False


def _integer(body: dict[str, Any], key: str) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool):
        raise Refusal(422, f"{key} must be an integer")
    return value


def budget(body: dict[str, Any], key: str) -> int | None:
    """`max_len` / `head_max_len`: a positive integer within MAX_TOKEN_BUDGET, or None."""
    value = _integer(body, key)
    if value is not None and value <= 0:
        raise Refusal(422, f"{key} must be a positive integer")
    if value is not None and value > MAX_TOKEN_BUDGET:
        raise Refusal(422, f"{key} exceeds server limit ({value} > {MAX_TOKEN_BUDGET})")
    return value


def batch_size(body: dict[str, Any]) -> int | None:
    value = _integer(body, "batch_size")
    if value is not None and value < 1:
        raise Refusal(422, f"batch_size must be a positive integer, got {value!r}")
    return value


def sort_by_length(body: dict[str, Any]) -> bool | None:
    value = body.get("sort_by_length")
    if value is not None and not isinstance(value, bool):
        raise Refusal(422, "sort_by_length must be a boolean")
    return value


def language(body: dict[str, Any], key: str) -> str | None:
    """`lang` / `lang_guess`: a language code string, or None."""
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise Refusal(422, f'{key} must be a language code string such as "de", or null')
    return value

