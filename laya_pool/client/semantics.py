"""Requests to token rows, exactly as the official SDK builds them.

`encode_request(card, state, questions)` returns the rows `laya.Agent.predict(state, questions)` feeds its
model, token for token: the same question validation (refused before anything is tokenized), the same
normalisation of question definitions, option rendering, head budget and state clamp. Any difference
here is a different answer, so every rule below is a rule of the SDK (laya 0.4.15, `laya.common`
`render_options` / `build_head` / `build_sequence` and `laya.agent.Agent._check_question` /
`_to_internal` / `_encode_state`); the tests hold it to the installed SDK.

One row per question:  [CLS] "<type> question: <instructions>" [SEP] [MASK] opt0 [MASK] opt1 ... [SEP] state [SEP]
"""
from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from laya_pool.protocol.contract import Reason
from laya_pool.protocol.qtypes import QUESTION_TYPES, QuestionType

from . import text
from .card import ModelCard
from .errors import RequestFailed
from .state import StateTokens, WindowPolicy, tokenize_state

OPTION_TOKEN_CAP = 48          # tokens of one option's text (after its [MASK])
_MIN_OPTION_BUDGET = 16        # below this many head tokens left for the instruction, options get capped
_MIN_OPTION_TOKENS = 4
_MIN_INSTRUCTION_TOKENS = 8
_HEAD_CACHE_SIZE = 2048         # question heads kept (`_head_arrays`), over all cards
_WHOLE = WindowPolicy(False)     # tokenizes every state whole
# the types that take `labels` (the answer's wording), as the refusal for any other names them
_LABELLED = " and ".join(t.name for t in QUESTION_TYPES if t.labels is not None)


class QuestionError(ValueError):
    """A question the SDK would refuse; the message names the question and what to fix."""

    def __init__(self, qid: Any, problem: str):
        super().__init__(f"question {qid!r}: {problem}" if qid is not None else problem)
        self.qid = qid


@dataclass
class EncodedRequest:
    """A request as token rows, plus what decoding needs to turn the model's logits into answers."""
    qids: list[Any]                                  # question ids, in the caller's order
    questions: list[dict[str, Any]]                  # normalised definitions (`to_internal`), same order
    rows: list[tuple[np.ndarray, np.ndarray, int]]   # (ids int32[n], markers int32[k], qtype)
    option_stats: list[dict[str, Any]]               # options, options_distinct, tokens_per_option
    kept: list[int]                                  # state tokens each row keeps
    max_len: int
    head_max_len: int
    state: StateTokens | None = None                 # None when there are no questions

    @property
    def state_stats(self) -> list[dict[str, Any]]:
        """Per row: state_tokens, state_tokens_used, _dropped, truncated (the SDK's truncation stats).

        `state_tokens` counts the whole state, which for a long state is still being tokenized in the
        background while the request runs: reading this waits for it."""
        total = self.state.count() if self.state is not None else 0
        return [{"state_tokens": total, "state_tokens_used": k, "state_tokens_dropped": total - k,
                 "truncated": k < total} for k in self.kept]

    @property
    def n_tokens(self) -> int:
        return sum(len(ids) for ids, _, _ in self.rows)

    @property
    def n_markers(self) -> int:
        return sum(len(markers) for _, markers, _ in self.rows)

    def __len__(self) -> int:
        return len(self.rows)


# ---------------------------------------------------------------- validation and normalisation


def _option_count(qtype: QuestionType, crit: Any) -> int:
    if qtype.fixed_options is not None:
        return qtype.fixed_options
    return len(crit) if isinstance(crit, (dict, list, tuple)) else 0


def check_question(qid: Any, qdef: Any) -> None:
    """Refuse a question the SDK refuses (`Agent._check_question`), with a `QuestionError` naming it."""
    if qid is None:
        raise QuestionError(None, "question id must not be None")
    if not isinstance(qid, (str, int)) or (isinstance(qid, str) and not qid.strip()):
        raise QuestionError(None, f"question id must be a non-empty string, got {qid!r}")
    if not isinstance(qdef, dict):
        raise QuestionError(qid, f"definition must be a dict, got {type(qdef).__name__}")
    qtype = QUESTION_TYPES.find(qdef.get("type"))
    if qtype is None:
        raise QuestionError(qid, f"unknown type {qdef.get('type')!r}; use one of {sorted(QUESTION_TYPES.names)}")
    _check_instructions(qid, qdef)
    try:
        qtype.check(qdef.get("criteria"))
    except ValueError as e:
        raise QuestionError(qid, str(e)) from e
    if "option_order" in qdef:
        order, n = qdef["option_order"], _option_count(qtype, qdef.get("criteria"))
        # Exactly the SDK's test: only real ints (not bools, not numpy ints) count as slots.
        if (not isinstance(order, (list, tuple)) or len(order) != n
                or sorted(int(i) for i in order if isinstance(i, int) and not isinstance(i, bool))
                != list(range(n))):
            raise QuestionError(qid, f"'option_order' must be a permutation of range({n}) -- one slot per "
                                     f"option, each option once -- got {order!r}")
    if "labels" in qdef:
        if qtype.labels is None:
            raise QuestionError(qid, f"'labels' is only supported for {_LABELLED} questions")
        try:
            qtype.labels(qdef["labels"])
        except ValueError as e:
            raise QuestionError(qid, str(e)) from e


def _check_instructions(qid: Any, qdef: dict[str, Any]) -> None:
    if "instructions" not in qdef:
        raise QuestionError(qid, "no 'instructions'; add the text the model should answer")
    ins = qdef["instructions"]
    if ins is None:
        raise QuestionError(qid, "'instructions' must not be None; add the text the model should answer")
    if (isinstance(ins, str) and not ins.strip()) or (isinstance(ins, (list, dict)) and not ins):
        raise QuestionError(qid, "'instructions' must not be empty; add the text the model should answer")
    if not isinstance(ins, (str, dict, list, int, float)):
        raise QuestionError(qid, f"'instructions' must be a string, dict, or list, got {type(ins).__name__}")


def to_internal(qdef: dict[str, Any]) -> dict[str, Any]:
    """A validated definition in the SDK's internal form `{"t", "ins", "crit"[, "labels"][, "option_order"]}`."""
    t = qdef["type"]
    crit = QUESTION_TYPES.by_name(t).internal(qdef.get("criteria"))
    ins = qdef["instructions"]
    if not isinstance(ins, str):
        ins = json.dumps(ins, ensure_ascii=False)
    q: dict[str, Any] = {"t": t, "ins": ins, "crit": crit}
    if "labels" in qdef:
        q["labels"] = qdef["labels"]
    if "option_order" in qdef:
        q["option_order"] = [int(i) for i in qdef["option_order"]]
    return q


# ---------------------------------------------------------------- rendering


def serialize_state(state: Any) -> str:
    return state if isinstance(state, str) else json.dumps(state, ensure_ascii=False)


def render_options(q: dict[str, Any]) -> list[str]:
    """Option texts in option-index order (noul is always [false, true])."""
    return QUESTION_TYPES.by_name(q["t"]).options(q)


def build_head(card: ModelCard, q: dict[str, Any], head_max_len: int) -> tuple[list[int], list[int], dict]:
    """`[CLS] <type> question: <ins> [SEP] [MASK] opt ... [SEP]`, the marker positions and the option stats."""
    return _assemble_head(card, q["t"], q["ins"], render_options(q), q.get("option_order"), head_max_len)


def _assemble_head(card: ModelCard, t: str, ins: str, opts: Sequence[str], order: Sequence[int] | None,
                   head_max_len: int) -> tuple[list[int], list[int], dict]:
    mask = card.mask_token
    if order is None:
        order = range(len(opts))
    # The mask token must appear only as an option marker, so user text loses it.
    ins_ids = card.encode_question_text(f"{t} question: " + ins.replace(mask, " "))
    opt_ids = [(card.mask_id,) + card.encode_question_text(" " + opts[i].replace(mask, " "))[:OPTION_TOKEN_CAP]
               for i in order]
    budget = head_max_len - sum(len(o) for o in opt_ids)
    per_option = None
    if budget < _MIN_OPTION_BUDGET:
        # The options would crowd out the instruction: cap each one evenly.
        per_option = max(_MIN_OPTION_TOKENS, (head_max_len - _MIN_OPTION_BUDGET) // max(1, len(opt_ids)))
        opt_ids = [o[:per_option] for o in opt_ids]
        budget = head_max_len - sum(len(o) for o in opt_ids)
    ids = [card.cls_id, *ins_ids[:max(_MIN_INSTRUCTION_TOKENS, budget)], card.sep_id]
    markers = []
    for o in opt_ids:
        markers.append(len(ids))
        ids.extend(o)
    ids.append(card.sep_id)
    # Options cut to the same span can no longer be told apart; decoding reports that in usage.
    stats = {"options": len(opt_ids), "options_distinct": len(set(opt_ids)), "tokens_per_option": per_option}
    return ids, markers, stats


def _head_arrays(card: ModelCard, q: dict[str, Any], head_max_len: int) -> tuple[np.ndarray, np.ndarray, dict]:
    """`build_head` as int32 arrays (read-only, possibly shared: copy before writing), cached by what it reads.

    A decision loop asks the same questions call after call: the rendered texts are the key, so two definitions
    with equal keys but different texts (1 and 1.0 as labels) never share an entry."""
    order = q.get("option_order")
    key = (q["t"], q["ins"], tuple(render_options(q)), None if order is None else tuple(order))
    if isinstance(head_max_len, int):
        return _cached_head(card, *key, head_max_len)
    return _head_as_arrays(card, *key, head_max_len)     # an odd override fails (or not) as it always did


def _head_as_arrays(card: ModelCard, t: str, ins: str, opts: tuple[str, ...], order: tuple[int, ...] | None,
                    head_max_len: int) -> tuple[np.ndarray, np.ndarray, dict]:
    ids, markers, stats = _assemble_head(card, t, ins, opts, order, head_max_len)
    return _read_only(ids), _read_only(markers), stats


def _read_only(values: list[int]) -> np.ndarray:
    a = np.asarray(values, dtype=np.int32)
    a.flags.writeable = False
    return a


# Keyed by the card too: a card is frozen and the cache holds it, so its entries cannot go stale. Bounded: a
# handful of cards at most, each with the few hundred questions a decision loop asks.
_cached_head = functools.lru_cache(maxsize=_HEAD_CACHE_SIZE)(_head_as_arrays)


# ---------------------------------------------------------------- requests


def state_bytes(serialized: str, limit: int) -> int:
    """The UTF-8 size of a serialized state, as far as comparing it with `limit` needs (no copy when it is ASCII,
    or clearly under or over the limit)."""
    if serialized.isascii() or len(serialized) > limit or 4 * len(serialized) <= limit:
        return len(serialized)
    return len(serialized.encode("utf-8", "surrogatepass"))


def check_state_size(state: Any, serialized: str, limit: int | None) -> None:
    """Refuse a state above the client's limit, before anything of it is tokenized."""
    if limit is None:
        return
    n = state_bytes(serialized, limit)
    if n > limit:
        what = "" if isinstance(state, str) else " (as JSON)"
        raise RequestFailed(f"state: {n:,} bytes of text{what} exceed the client's limit of {limit:,} "
                            "(max_state_bytes, $LAYA_POOL_MAX_STATE_BYTES): the model reads at most max_len tokens "
                            "of a state; send the part that matters, or predict_long for a document",
                            field="state", reason=Reason.TOO_LARGE)


def _state_tokens(card: ModelCard, state: Any, need: int, from_left: bool, window: bool,
                  max_state_bytes: int | None) -> StateTokens:
    """The state's tokens as far as rows keep `need` of them (client/state.py), its whole count started."""
    try:
        serialized = serialize_state(state)
    except (TypeError, ValueError) as e:
        raise text.state_error(state, e) from e
    check_state_size(state, serialized, max_state_bytes)
    try:
        serialized = serialized.replace(card.mask_token, " ")
        tokens = tokenize_state(card.encode, card.window if window else _WHOLE, serialized, need, from_left,
                                card.encode_many)
    except (TypeError, ValueError) as e:
        raise text.state_error(state, e) from e
    # The whole state's count (usage) starts now, beside the caller: the tokenizer releases the GIL, so it runs
    # while rows are built and sent, and while an in-process caller's forward runs (no wait at decode).
    tokens.start()
    return tokens


def encode_request(card: ModelCard, state: Any, questions: dict[Any, Any],
                   max_len: int | None = None, head_max_len: int | None = None,
                   window: bool = True, max_state_bytes: int | None = None) -> EncodedRequest:
    """Token rows for `predict(state, questions)`, one per question in the caller's order.

    Raises `TypeError` for a state of None or questions that are not a dict, `QuestionError` for a
    question the SDK refuses (all are checked before the state is tokenized) or whose options do not
    fit in `max_len`. `max_len` / `head_max_len` override the card's, as the SDK's per-call overrides do.
    A long state is tokenized only as far as the rows keep it (`client.state`; `window=False` tokenizes
    it whole), and its whole count finishes in the background (`EncodedRequest.state_stats` waits). A state whose
    text is over `max_state_bytes` raises `RequestFailed` (field `state`) before anything of it is tokenized.
    """
    if not isinstance(questions, dict):
        raise TypeError(f"questions must be a dict of question id -> definition, got {type(questions).__name__}")
    if state is None:
        raise TypeError("state must not be None; pass a string, dict, or list")
    max_len = card.max_len if max_len is None else max_len
    head_max_len = card.head_max_len if head_max_len is None else head_max_len
    qids = list(questions)
    for qid in qids:
        check_question(qid, questions[qid])
    internal = [to_internal(questions[qid]) for qid in qids]
    out = EncodedRequest(qids, internal, [], [], [], max_len, head_max_len)
    if not qids:
        return out   # the SDK answers an empty question set without tokenizing anything

    heads = []
    for qid, q in zip(qids, internal):
        try:
            heads.append(_head_arrays(card, q, head_max_len))
        except (TypeError, ValueError) as e:     # bytes or lone surrogates: say where (client/text.py)
            raise QuestionError(qid, text.problem(questions[qid], "definition") or str(e)) from e
    rooms = [max(0, max_len - len(head) - 1) for head, _, _ in heads]    # -1: the [SEP] closing the state
    # A conversation is newest-last: cut it from the left so the latest turn survives.
    from_left = isinstance(state, list)
    out.state = tokens = _state_tokens(card, state, max(rooms), from_left, window, max_state_bytes)
    n = len(tokens.ids)
    state_ids = np.asarray(tokens.ids, dtype=np.int32)
    sep = np.asarray([card.sep_id], dtype=np.int32)
    for qid, q, (head, markers, opt_stats), room in zip(qids, internal, heads, rooms):
        keep = min(room, n)    # the window holds at least max(rooms) tokens, or the whole state
        kept = state_ids[n - keep:] if from_left else state_ids[:keep]
        ids = np.concatenate((head, kept, sep))[:max_len]
        # Markers ascend, so only a head longer than max_len loses any; every row gets its own (the head's are shared).
        markers = markers[markers < max_len] if markers.size and markers[-1] >= max_len else markers.copy()
        if len(markers) != opt_stats["options"]:
            raise QuestionError(qid, f"only {len(markers)} of its {opt_stats['options']} option markers fit in "
                                     f"max_len={max_len} with head_max_len={head_max_len} spent on the question; "
                                     "lower head_max_len, raise max_len, or use fewer options")
        out.rows.append((ids, markers, QUESTION_TYPES.by_name(q["t"]).id))
        out.option_stats.append(dict(opt_stats))
        out.kept.append(keep)
    return out
