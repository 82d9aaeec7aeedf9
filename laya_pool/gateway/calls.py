"""From a parsed request body to the pool call that answers it: `laya serve` 0.4.15's checks, in its order (so the
first fault a body has is the one reported), then the keyword arguments of `AsyncClient.predict` / `predict_batch`
and the `routing` block the answer carries.

Pure: no HTTP and no pool here (app.py does both).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from laya_pool.client.abstain import check_min_confidence

from . import limits
from .limits import Refusal
from .naming import Checkpoint


@dataclass
class Call:
    """What to ask the pool: `states` (one for /v1/systemone), `questions`, keyword arguments, the routing block."""
    states: list[Any]
    questions: dict[Any, Any]
    kwargs: dict[str, Any] = field(default_factory=dict)
    routing: dict[str, Any] = field(default_factory=dict)


def single(body: Any, checkpoint: Checkpoint) -> Call:
    """`POST /v1/systemone`: `{"state", "questions", ...controls}`."""
    if not isinstance(body, dict) or "questions" not in body:
        raise Refusal(400, "request body must be an object with a 'questions' field")
    state, questions = body.get("state"), body["questions"]
    limits.check_request(state, questions)
    limits.refuse_controls(body)
    if limits.has_lone_surrogate(body):
        raise Refusal(400, limits.LONE_SURROGATE)
    call = _controls(body, checkpoint, Call([state], questions))
    call.routing = checkpoint.route(body.get("model"), body.get("task"))    # an unknown task: 422, as routing does
    return call


def batch(body: Any, checkpoint: Checkpoint) -> Call:
    """`POST /v1/systemone/batch`: `{"states", "questions", ...controls}`; one answer per state, in order."""
    if not isinstance(body, dict) or "questions" not in body or "states" not in body:
        raise Refusal(400, "request body must be an object with 'states' and 'questions' fields")
    states, questions = body["states"], body["questions"]
    limits.check_batch(states, questions)
    limits.refuse_controls(body, batch=True)
    if limits.has_lone_surrogate(body):
        raise Refusal(400, limits.LONE_SURROGATE)
    call = _controls(body, checkpoint, Call(states, questions))
    size = limits.batch_size(body)
    if size is not None:
        call.kwargs["batch_size"] = size
    if limits.sort_by_length(body):
        call.kwargs["sort_by_length"] = True
    call.routing = checkpoint.route(body.get("model"), body.get("task"))
    return call


def _controls(body: dict[str, Any], checkpoint: Checkpoint, call: Call) -> Call:
    """The controls both routes share, checked in `laya serve`'s order; each is passed only when the body set it."""
    checkpoint.route(body.get("model"), None)     # a model the pool does not serve: 422 before the budgets
    for key in ("max_len", "head_max_len"):
        value = limits.budget(body, key)
        if value is not None:
            call.kwargs[key] = value
    lang = limits.language(body, "lang")
    limits.language(body, "lang_guess")           # checked; it routes between checkpoints, and there is one
    if lang is not None:
        call.kwargs["lang"] = lang
    if body.get("min_confidence") is not None:
        try:
            call.kwargs["min_confidence"] = check_min_confidence(body["min_confidence"])
        except ValueError as e:
            raise Refusal(422, str(e)) from None
    return call
