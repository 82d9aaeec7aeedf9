"""The question types, one record each: the one place a type is defined.

A type's `id` is the checkpoint's index for it: the decision head adds `type_emb[id]` to every token of the
question's row and decodes at `temperature[id]`, so the number of types, `len(QUESTION_TYPES)`, is the number of
rows of both (kernels/arch.py sizes them from it, the worker refuses a row whose type is not an id here). What a
room does differently per type is a field of the record, looked up by name or id, never an if/elif on the name:

- `check` / `internal`: validation and normalisation of `criteria` (client/semantics.py `check_question`,
  `to_internal`), and `labels`: the answer wording only noul takes;
- `options`: the option texts a row carries after its `[MASK]` markers (client/semantics.py `render_options`),
  and `fixed_options`: a count that holds whatever the criteria (noul: false, true);
- `answer`: the answer dict from the option probabilities (client/decode.py), whose option-count bucket
  (`option_bucket`) picks temperatures, a calibration's bins and an abstention threshold (client/abstain.py);
- `window_score`: which window of a long state decides the answer (client/scan.py);
- `schema`: the JSON-schema properties asked as the type and how its answer reads back (client/structured.py);
- `served`: what the SDK's HTTP server bounds and adds per type (laya_pool/gateway: limits.py, jev.py).

docs/architecture.md ("Adding a question type") lists what else a new type changes. Every rule is the SDK's
(laya 0.4.15: `laya.common` QTYPES / render_options / temp_bucket, `laya.agent.Agent` _check_question /
_to_internal / _decode_answers / predict_long, `laya.confidence`, `laya.structured`); the client tests hold
them to the installed SDK. Pure Python and numpy: every room may import it.
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

MAX_SCORE_LEVELS = 10          # a schema's integer range becomes at most this many score levels
SIZES = ("2", "3-5", "6-10", "11+")    # the option-count bands of a bucket ("choice:3-5")
NOUL_FALSE_TEXT = "no, the statement does not hold"
NOUL_TRUE_TEXT = "yes, the statement holds"
_NOUL_LABELS_RULE = "noul labels must map exactly 'false' and 'true' to distinct non-empty strings"

Question = dict[str, Any]      # a definition in the SDK's internal form: {"t", "ins", "crit"[, "labels"]...}
Answer = dict[str, Any]


# ---------------------------------------------------------------------------------------------- the record

@dataclass(frozen=True)
class Schema:
    """How a JSON-schema property becomes a question of the type (`decide`), and its answer the property's value.

    `question(name, property, description)` gives the question definition and what reading its answer back
    needs (ValueError names what the property lacks); `value(answer, reading)` the property's value;
    `probabilities(answer)` the answer's `DecisionResult.probabilities`."""
    json_types: tuple[str, ...]    # the JSON `type`s of a property asked as this type
    enum: bool                     # whether an `enum` (or a `const`) is asked as this type
    question: Callable[[str, dict[str, Any], str | None], tuple[dict[str, Any], Any]]
    value: Callable[[Answer, Any], Any]
    probabilities: Callable[[Answer], dict[str, Any]]

    def __post_init__(self) -> None:
        missing = [f.name for f in fields(self) if f.name not in ("json_types", "enum")
                   and not callable(getattr(self, f.name))]
        if missing:
            raise TypeError(f"schema of a question type: missing {', '.join(missing)}")


@dataclass(frozen=True)
class Served:
    """What `laya serve` 0.4.15 does per type over HTTP (laya_pool/gateway).

    `count(criteria)` the options the server bounds, or None where it does not count them (`max_options` of them
    at most, refused as "too many `options_word` for 'q'"); `null_refusal` the 422 text for a null criterion
    (formatted with `qid` and `index`), for a type whose server refuses one before validation; `strict_fields` an
    answer's fields in the strict Jev contract; `jev_order(probabilities)` the keys in option order and
    `jev_confidence(p)` Jev's confidence from the normalized probabilities in that order (None: the type has none).
    """
    count: Callable[[Any], int | None] | None = None
    max_options: int | None = None
    options_word: str = ""
    null_refusal: str | None = None
    strict_fields: tuple[str, ...] = ("type",)
    jev_order: Callable[[dict[Any, Any]], list[Any]] | None = None
    jev_confidence: Callable[[list[float]], float] | None = None

    def __post_init__(self) -> None:
        if (self.count is None) != (self.max_options is None) or (self.jev_order is None) != (
                self.jev_confidence is None):
            raise TypeError("served part of a question type: count needs max_options, jev_order jev_confidence")


@dataclass(frozen=True)
class QuestionType:
    """One question type: its name and checkpoint index, and every rule the rooms apply to it.

    `check` raises ValueError naming what the SDK refuses in a definition's `criteria`; `internal` gives checked
    criteria in the SDK's internal form; `options(question)` the option texts in option-index order, and
    `fixed_options` their count when it does not follow the criteria; `answer(question, p, k)` the answer's
    fields up to "confidence" (decoding adds "answer_confidence" and "action"); `window_score(answer)` rates
    the windows of a long state, the highest decides; `labels` checks a definition's `labels`, for a type
    that takes them."""
    name: str                                   # the definition's and the answer's "type", and the prompt's word
    id: int                                     # the row's type: its index into type_emb and temperature
    check: Callable[[Any], None]
    internal: Callable[[Any], Any]
    options: Callable[[Question], list[str]]
    fixed_options: int | None
    answer: Callable[[Question, np.ndarray, int], Answer]
    window_score: Callable[[Answer], float]
    schema: Schema
    served: Served
    labels: Callable[[Any], tuple[str, str]] | None = None

    def __post_init__(self) -> None:
        # A record without one of its pieces would fail one dispatcher, on some call, far from here.
        missing = [f.name for f in fields(self) if f.name not in _DATA and not callable(getattr(self, f.name))]
        if not isinstance(self.schema, Schema):
            missing.append("schema")
        if not isinstance(self.served, Served):
            missing.append("served")
        if missing:
            raise TypeError(f"question type {self.name!r}: missing {', '.join(missing)}")


_DATA = ("name", "id", "fixed_options", "labels", "schema", "served")     # the fields of a record that are not rules


# ---------------------------------------------------------------------------------------------- shared rules

def option_bucket(name: str, k: int) -> str:
    """The bucket of a question type and option count, e.g. "choice:3-5": the key of `temperature_by_options`,
    of a calibration's `binning_map` and of a `min_confidence` map."""
    size = "2" if k <= 2 else "3-5" if k <= 5 else "6-10" if k <= 10 else "11+"
    return f"{name}:{size}"


def render_criterion(value: Any) -> str:
    """A criterion as text: strings as they are, anything structured as one line of JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, separators=(", ", ": "), default=str)


def entropy_confidence(p: np.ndarray, k: int) -> float:
    """1 - H(p)/log(k), the SDK's `confidence` for choice and score (not calibrated)."""
    if k < 2:
        return 1.0
    pk = p[:k]
    # np.clip's bits through its two ufuncs, without its Python wrapper (a third of this function's time).
    ent = -float((pk * np.log(np.minimum(np.maximum(pk, 1e-12), 1.0))).sum())
    score = 1.0 - ent / math.log(k)
    return 0.0 if score < 0.0 else (1.0 if score > 1.0 else score)


def _by_answer_confidence(answer: Answer) -> float:
    return float(answer["answer_confidence"])


def _listed_probabilities(answer: Answer) -> dict[str, Any]:
    return dict(answer.get("probabilities") or {})


def _as_given(crit: Any) -> Any:
    return crit


def _listed(probabilities: dict[Any, Any]) -> list[Any]:
    return list(probabilities)


# ---------------------------------------------------------------------------------------------- choice

def _check_choice(crit: Any) -> None:
    if not isinstance(crit, (dict, list)):
        raise ValueError("a choice question takes 'criteria' as a dict of label -> description, or a list of labels")
    if not crit:
        raise ValueError("a choice question needs at least one criterion")
    for i, label in enumerate(crit if isinstance(crit, list) else list(crit.keys())):
        # A label is both option text and answer key, so only scalars that survive both qualify.
        if label is None:
            raise ValueError(f"choice label {i} is null; a label is option text and the answer key, so it must be "
                             "a string, number or bool")
        if not isinstance(label, (str, int, float, bool)):
            raise ValueError(f"choice label {i} is a {type(label).__name__}; a label must be a scalar (a string, "
                             f"number or bool), got {label!r}")
    if isinstance(crit, list):
        _check_distinct_labels(crit)


def _check_distinct_labels(labels: list[Any]) -> None:
    # Labels become dict keys, so values Python treats as one key (1, 1.0, True) would merge options.
    seen: dict[Any, int] = {}
    for i, label in enumerate(labels):
        try:
            first = seen[label]
        except TypeError as e:
            raise ValueError(f"choice label {i} ({label!r}) is unhashable and cannot be an answer key") from e
        except KeyError:
            seen[label] = i
        else:
            raise ValueError(f"choice label {i} ({label!r}) repeats label {first}; every option needs its own "
                             "answer key (1, 1.0 and True are one key)")


def _choice_internal(crit: Any) -> Any:
    return {c: None for c in crit} if isinstance(crit, list) else crit


def _choice_options(q: Question) -> list[str]:
    # Only None and "" mean "no description": 0 and False are descriptions.
    return [str(k) if v is None or v == "" else f"{k!s}: {render_criterion(v)}" for k, v in q.get("crit").items()]


def _choice_answer(q: Question, p: np.ndarray, k: int) -> Answer:
    keys = list(q["crit"].keys())
    return {
        "type": "choice",
        "choice": keys[int(p.argmax())],     # the caller's own label, type and all
        "probabilities": {key: round(float(v), 4) for key, v in zip(keys, p)},
        "confidence": round(entropy_confidence(p, k), 4),
    }


def _choice_question(name: str, prop: dict[str, Any], description: str | None) -> tuple[dict[str, Any], Any]:
    options = [("null" if v is None else str(v), v) for v in prop["enum"]]
    if len({label for label, _ in options}) != len(options):
        raise ValueError("enum values produce duplicate choice labels")
    question = {"type": "choice", "instructions": description or f"What is `{name}`?",
                "criteria": {label: None for label, _ in options}}
    return question, options


def _choice_value(answer: Answer, options: list[tuple[str, Any]]) -> Any:
    label = str(answer.get("choice"))
    return next((value for lbl, value in options if lbl == label), label)


def _choice_count(crit: Any) -> int | None:
    return len(crit) if isinstance(crit, (dict, list)) else None


def _jev_choice(p: list[float]) -> float:
    # Jev's choice confidence: how far the top probability stands above uniform, 0 (uniform) to 1 (certain).
    n = len(p)
    return (max(p) - 1.0 / n) / (1.0 - 1.0 / n)


CHOICE = QuestionType(
    name="choice", id=0, check=_check_choice, internal=_choice_internal, options=_choice_options,
    fixed_options=None, answer=_choice_answer, window_score=_by_answer_confidence,
    schema=Schema(json_types=(), enum=True, question=_choice_question, value=_choice_value,
                  probabilities=_listed_probabilities),
    served=Served(count=_choice_count, max_options=100, options_word="choice options",
                  strict_fields=("type", "choice", "confidence", "probabilities"),
                  jev_order=_listed, jev_confidence=_jev_choice))


# ---------------------------------------------------------------------------------------------- score

def _check_score(crit: Any) -> None:
    if not isinstance(crit, list):
        raise ValueError("a score question takes 'criteria' as a list of level descriptions, index 0 first")
    if not crit:
        raise ValueError("a score question needs at least one level")
    if None in crit:
        raise ValueError(f"score level {crit.index(None)} is null; give every level a description")


def _score_options(q: Question) -> list[str]:
    return [f"level {i}: {render_criterion(c)}" for i, c in enumerate(q.get("crit"))]


def _score_answer(q: Question, p: np.ndarray, k: int) -> Answer:
    return {
        "type": "score",
        "score": round(float((np.arange(k) * p).sum()), 4),
        "legend": {str(i): render_criterion(c) for i, c in enumerate(q["crit"])},
        "probabilities": {str(i): round(float(v), 4) for i, v in enumerate(p)},
        "confidence": round(entropy_confidence(p, k), 4),
    }


def _score_question(name: str, prop: dict[str, Any], description: str | None) -> tuple[dict[str, Any], Any]:
    lo, hi = prop.get("minimum"), prop.get("maximum")
    # A bool is an int to Python but a yes/no to a schema: not a bound.
    if isinstance(lo, bool) or isinstance(hi, bool) or not isinstance(lo, int) or not isinstance(hi, int):
        raise ValueError("a numeric field needs integer 'minimum' and 'maximum' to become a score")
    if hi < lo:
        raise ValueError(f"'maximum' {hi} is below 'minimum' {lo}")
    span = hi - lo + 1
    if span > MAX_SCORE_LEVELS:
        raise ValueError(f"{span} levels exceeds MAX_SCORE_LEVELS={MAX_SCORE_LEVELS}; narrow the range or use an enum")
    question = {"type": "score", "instructions": description or f"Score `{name}` from {lo} to {hi}",
                "criteria": [str(v) for v in range(lo, hi + 1)]}
    return question, lo


def _score_value(answer: Answer, minimum: int | None) -> int:
    probs = answer.get("probabilities") or {}
    if probs:       # the most probable level (not the rounded expectation)
        idx = max(range(len(probs)), key=lambda i: float(probs.get(str(i), probs.get(i, 0.0))))
    else:
        idx = int(round(float(answer.get("score", 0.0))))
    return int(minimum or 0) + idx


def _score_count(crit: Any) -> int | None:
    return len(crit) if isinstance(crit, list) else None


def _by_level(probabilities: dict[Any, Any]) -> list[Any]:
    return sorted(probabilities, key=int)


def _jev_score(p: list[float]) -> float:
    # Jev's score confidence: 1 - the expected distance from the mode over that of a uniform spread about the centre.
    n = len(p)
    mode = max(range(n), key=p.__getitem__)
    spread = sum(v * abs(i - mode) for i, v in enumerate(p))
    center = (n - 1) / 2
    uniform = sum(abs(i - center) for i in range(n)) / n
    return max(0.0, 1.0 - spread / uniform)


SCORE = QuestionType(
    name="score", id=1, check=_check_score, internal=_as_given, options=_score_options,
    fixed_options=None, answer=_score_answer, window_score=_by_answer_confidence,
    schema=Schema(json_types=("integer", "number"), enum=False, question=_score_question, value=_score_value,
                  probabilities=_listed_probabilities),
    served=Served(count=_score_count, max_options=32, options_word="score levels",
                  null_refusal=("score question {qid!r} has a null level at index {index}; give every level a "
                                "description"),
                  strict_fields=("type", "score", "confidence", "probabilities", "legend"),
                  jev_order=_by_level, jev_confidence=_jev_score))


# ---------------------------------------------------------------------------------------------- noul

def _check_noul(crit: Any) -> None:
    if crit is not None and not isinstance(crit, dict):
        raise ValueError("a noul question takes 'criteria' as a dict with optional 'true'/'false' descriptions, "
                         "or omits it")
    if isinstance(crit, dict):
        keys = {str(k).lower() for k in crit}
        if not keys <= {"true", "false"}:
            raise ValueError(f"a noul question takes 'criteria' keyed only 'true'/'false', got {sorted(keys)}; "
                             "use 'labels' to word the answer differently")


def _noul_internal(crit: Any) -> Any:
    return {str(k).lower(): v for k, v in crit.items()} if isinstance(crit, dict) else crit


def resolve_noul_labels(labels: Any = None) -> tuple[str, str]:
    """The (false, true) texts a noul question shows; `None` means the defaults "false" / "true"."""
    if labels is None:
        labels = {"false": "false", "true": "true"}
    if not isinstance(labels, dict) or set(labels) != {"false", "true"}:
        raise ValueError(_NOUL_LABELS_RULE)
    false_label, true_label = labels["false"], labels["true"]
    if not isinstance(false_label, str) or not isinstance(true_label, str):
        raise ValueError(_NOUL_LABELS_RULE)
    false_label, true_label = false_label.strip(), true_label.strip()
    if not false_label or not true_label or false_label == true_label:
        raise ValueError(_NOUL_LABELS_RULE)
    return false_label, true_label


def _noul_options(q: Question) -> list[str]:
    crit = q.get("crit") or {}
    false_label, true_label = resolve_noul_labels(q.get("labels"))
    false_crit, true_crit = crit.get("false"), crit.get("true")
    return [
        false_label + ": " + (render_criterion(false_crit) if false_crit not in (None, "") else NOUL_FALSE_TEXT),
        true_label + ": " + (render_criterion(true_crit) if true_crit not in (None, "") else NOUL_TRUE_TEXT),
    ]


def _noul_answer(q: Question, p: np.ndarray, k: int) -> Answer:
    p_true = float(p[1])
    return {"type": "noul", "noul": round(p_true, 4), "confidence": round(max(p_true, 1.0 - p_true), 4)}


def _by_p_true(answer: Answer) -> float:
    # Evidence anywhere: the statement holds if any window supports it.
    return float(answer["noul"])


def _noul_question(name: str, prop: dict[str, Any], description: str | None) -> tuple[dict[str, Any], Any]:
    return {"type": "noul", "instructions": description or f"Is `{name}` true?"}, None


def _noul_value(answer: Answer, _: Any) -> bool:
    return bool(float(answer.get("noul", 0.0)) >= 0.5)


def _noul_probabilities(answer: Answer) -> dict[str, Any]:
    p = float(answer.get("noul", 0.0))
    return {"false": round(1.0 - p, 4), "true": round(p, 4)}


NOUL = QuestionType(
    name="noul", id=2, check=_check_noul, internal=_noul_internal, options=_noul_options,
    fixed_options=2, answer=_noul_answer, window_score=_by_p_true,
    schema=Schema(json_types=("boolean",), enum=False, question=_noul_question, value=_noul_value,
                  probabilities=_noul_probabilities),
    served=Served(strict_fields=("type", "noul")),
    labels=resolve_noul_labels)


# ---------------------------------------------------------------------------------------------- the registry

class Registry:
    """The types in id order, looked up by name, by id, or by the JSON-schema property they are asked for."""

    def __init__(self, types: tuple[QuestionType, ...]):
        if [t.id for t in types] != list(range(len(types))):
            raise ValueError(f"question type ids must be 0..{len(types) - 1} in order (the checkpoint's rows), "
                             f"got {[t.id for t in types]}")
        self.types = types
        self.names = tuple(t.name for t in types)
        self._by_name = {t.name: t for t in types}
        self._by_json_type = {j: t for t in types for j in t.schema.json_types}
        enum = [t for t in types if t.schema.enum]
        if (len(self._by_name) != len(types) or len(enum) != 1
                or len(self._by_json_type) != sum(len(t.schema.json_types) for t in types)):
            raise ValueError("every question type needs its own name, and JSON types and enums one type each")
        self.enum_type = enum[0]        # the type an `enum` or a `const` property is asked as

    def __len__(self) -> int:
        return len(self.types)

    def __iter__(self) -> Iterator[QuestionType]:
        return iter(self.types)

    def by_name(self, name: str) -> QuestionType:
        """The type named `name` (a name `check_question` accepted); KeyError otherwise."""
        return self._by_name[name]

    def find(self, name: Any) -> QuestionType | None:
        """The type named `name`, or None for anything else (an answer a hook rewrote, a non-string)."""
        return self._by_name.get(name) if isinstance(name, str) else None

    def by_id(self, qtype: int) -> QuestionType:
        """The type a row carries; KeyError for an id no type has."""
        t = int(qtype)
        if not 0 <= t < len(self.types):
            raise KeyError(qtype)
        return self.types[t]

    def by_json_type(self, json_type: Any) -> QuestionType | None:
        """The type a property of this JSON `type` ("boolean", "integer", ...) is asked as, or None."""
        return self._by_json_type.get(json_type) if isinstance(json_type, str) else None

    def buckets(self) -> set[str]:
        """Every option-count bucket an answer can fall in."""
        return {f"{t.name}:{size}" for t in self.types for size in SIZES}


QUESTION_TYPES = Registry((CHOICE, SCORE, NOUL))
