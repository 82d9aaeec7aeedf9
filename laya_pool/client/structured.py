"""`decide` / `decide_batch`: a JSON schema (or a pydantic model) as questions, answers as schema values.

The SDK's documented subset (laya 0.4.15 `laya.structured`), rule for rule: an object of properties,
each an enum or const (a choice; a two-valued boolean enum is a noul), a boolean (a noul) or an integer
with `minimum` / `maximum` (a score of at most 10 levels); local `$ref`s, `Optional[...]` unions and
one-item `allOf`s are unwrapped. Free strings, arrays and nested objects are refused with a
`SchemaError` naming the path. A pydantic model is read through its own `model_json_schema()` (or v1
`schema()`), so pydantic is never imported here.

No I/O: the client plans the questions here, asks the pool, and projects the answers here.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from laya_pool.protocol.qtypes import QUESTION_TYPES, QuestionType

from .abstain import answer_confidence_value, apply_confidence_gate, check_min_confidence

MAX_PROPERTIES = 32
MAX_OPTIONS = 32
_LOCAL_REFS = (("#/$defs/", "$defs"), ("#/definitions/", "definitions"))
_ONE_STATE = object()       # Decision.plan for decide (one state), not decide_batch


class SchemaError(ValueError):
    """A schema that cannot be expressed as questions; the message names the path."""


@dataclass
class DecisionResult:
    """`decide(..., return_details=True)`: the values plus, per field, the SDK's confidences and answers."""
    values: dict[str, Any]
    confidence: dict[str, float]
    probabilities: dict[str, dict[str, Any]]
    answers: dict[str, Any]
    usage: dict[str, Any] | None = None
    routing: dict[str, Any] | None = None
    answer_confidence: dict[str, float | None] = field(default_factory=dict)


@dataclass
class Field:
    """One schema property as a question, and how its answer becomes a value."""
    name: str
    kind: str                   # the question type's name
    question: dict[str, Any]
    reading: Any = None         # what the type reads its answer back with (choice: its (label, value) pairs)


# ---------------------------------------------------------------- schema -> fields


def schema_of(model: Any) -> dict[str, Any]:
    """A JSON schema dict from a dict, a pydantic v2 model (`model_json_schema`) or a v1 model (`schema`)."""
    if hasattr(model, "model_json_schema"):
        return model.model_json_schema()
    if hasattr(model, "schema"):
        return model.schema()
    if isinstance(model, dict):
        return model
    raise SchemaError(f"expected a JSON schema dict or a pydantic model, got {type(model).__name__}")


def _typed_field(path: str, name: str, qtype: QuestionType, prop: dict[str, Any], description: str | None) -> Field:
    try:
        question, reading = qtype.schema.question(name, prop, description)
    except ValueError as e:
        raise SchemaError(f"{path}: {e}") from e
    return Field(name, qtype.name, question, reading)


def _enum_field(path: str, name: str, values: Any, description: str | None) -> Field:
    # A str is iterable: refused before len() so it does not become one option per character.
    if not isinstance(values, (list, tuple)):
        raise SchemaError(f"{path}: 'enum' must be an array of values, got {type(values).__name__}")
    if len(values) > MAX_OPTIONS:
        raise SchemaError(f"{path}: {len(values)} options exceeds MAX_OPTIONS={MAX_OPTIONS}")
    if not values:
        raise SchemaError(f"{path}: 'enum' must not be empty")
    if all(isinstance(v, bool) for v in values) and len(set(values)) == 2:      # true/false: a boolean
        return _typed_field(path, name, QUESTION_TYPES.by_json_type("boolean"), {"type": "boolean"}, description)
    return _typed_field(path, name, QUESTION_TYPES.enum_type, {"enum": values}, description)


def _inline_ref(path: str, prop: dict[str, Any], root: dict[str, Any],
                seen: tuple[str, ...]) -> tuple[dict[str, Any], tuple[str, ...]]:
    """A local `$ref` replaced by its definition (less the definition's description), the property's keys on top."""
    ref = prop["$ref"]
    if ref in seen:
        raise SchemaError(f"{path}: $ref {ref!r} is recursive; flatten the schema")
    target = None
    for prefix, key in _LOCAL_REFS:
        defs = root.get(key)
        if isinstance(ref, str) and ref.startswith(prefix) and isinstance(defs, dict):
            target = defs.get(ref[len(prefix):])
    if not isinstance(target, dict):
        raise SchemaError(f"{path}: $ref {ref!r} does not resolve to an entry of this schema's '$defs' or "
                          "'definitions'")
    merged = {k: v for k, v in target.items() if k != "description"}
    merged.update((k, v) for k, v in prop.items() if k != "$ref")
    return merged, seen + (ref,)


def _field(path: str, name: str, prop: Any, root: dict[str, Any], seen: tuple[str, ...] = ()) -> Field:
    if not isinstance(prop, dict):
        raise SchemaError(f"{path}: property must be an object, got {type(prop).__name__}")
    while "$ref" in prop:
        prop, seen = _inline_ref(path, prop, root, seen)
    description = prop.get("description")
    if not ({"const", "enum", "type"} & set(prop)):
        wrapped = prop.get("allOf")           # pydantic v1's described $ref
        if isinstance(wrapped, list) and len(wrapped) == 1 and isinstance(wrapped[0], dict):
            branch = dict(wrapped[0])
            branch.update((k, v) for k, v in prop.items() if k != "allOf")
            return _field(path, name, branch, root, seen)
        union = prop.get("anyOf") or prop.get("oneOf")
        if union is not None:                 # Optional[X]: the one non-null branch
            branches = [b for b in union if isinstance(b, dict) and b.get("type") != "null"]
            if len(branches) != 1:
                raise SchemaError(f"{path}: only 'Optional[...]' unions (one non-null branch) are supported, "
                                  f"got {len(branches)}")
            branch = dict(branches[0])
            branch.setdefault("description", description)
            return _field(path, name, branch, root, seen)
    if "const" in prop:
        return _enum_field(path, name, [prop["const"]], description)
    if "enum" in prop:
        return _enum_field(path, name, prop["enum"], description)
    jtype = prop.get("type")
    if isinstance(jtype, list):               # nullable: ["string", "null"]
        non_null = [t for t in jtype if t != "null"]
        if len(non_null) > 1:
            raise SchemaError(f"{path}: 'type' has multiple non-null types; unions are not supported")
        jtype = non_null[0] if non_null else None
    qtype = QUESTION_TYPES.by_json_type(jtype)
    if qtype is not None:
        return _typed_field(path, name, qtype, prop, description)
    if jtype == "string":
        raise SchemaError(f"{path}: a free string cannot be a fixed option set; use 'enum' or a boolean")
    if jtype == "array":
        raise SchemaError(f"{path}: arrays are not supported; ask one field per element")
    if jtype == "object":
        raise SchemaError(f"{path}: nested objects are not supported; flatten the schema")
    raise SchemaError(f"{path}: unsupported schema {prop!r}")


def plan_from_json_schema(schema: Any) -> list[Field]:
    """One field per property of `schema`, or a `SchemaError` naming what cannot be asked."""
    if not isinstance(schema, dict):
        raise SchemaError(f"expected a JSON schema object, got {type(schema).__name__}")
    if schema.get("type") not in (None, "object") or "properties" not in schema:
        raise SchemaError("the top level must be an object with 'properties'")
    properties = schema["properties"]
    if not isinstance(properties, dict) or not properties:
        raise SchemaError("'properties' must be a non-empty object")
    if len(properties) > MAX_PROPERTIES:
        raise SchemaError(f"{len(properties)} properties exceeds MAX_PROPERTIES={MAX_PROPERTIES}")
    return [_field(f"properties.{name}", name, prop, schema) for name, prop in properties.items()]


def questions_from_json_schema(schema: Any) -> dict[str, dict[str, Any]]:
    return {f.name: f.question for f in plan_from_json_schema(schema)}


# ---------------------------------------------------------------- a decision: plan, then project


@dataclass
class Decision:
    """What `decide` asks (`questions`) and how it reads the answers back (`fields`, None: raw answers)."""
    questions: dict[str, Any]
    fields: list[Field] | None
    min_confidence: float | dict[str, float] | None
    return_details: bool

    @classmethod
    def plan(cls, schema: Any, questions: Any, min_confidence: Any, return_details: bool,
             batch: Any = _ONE_STATE) -> Decision:
        """Exactly one of `schema` / `questions`; `batch` (decide_batch's states) a sequence; the threshold
        valid: all checked before anything is asked, in the SDK's order."""
        if (schema is None) == (questions is None):
            raise ValueError("pass exactly one of schema= or questions=")
        if batch is not _ONE_STATE and (isinstance(batch, (str, bytes)) or not isinstance(batch, Sequence)):
            raise TypeError(f"states must be a sequence of states, not {type(batch).__name__}")
        mc = check_min_confidence(min_confidence) if min_confidence is not None else None
        fields = None
        if schema is not None:
            fields = plan_from_json_schema(schema_of(schema))
            questions = {f.name: f.question for f in fields}
        return cls(questions, fields, mc, return_details)

    def read(self, result: dict[str, Any]) -> Any:
        """The values (or a `DecisionResult`) for one `predict` result, gated at the threshold."""
        if isinstance(result, dict):
            apply_confidence_gate([result], self.min_confidence)
        answers = result.get("answers", {}) or {}
        values = project(answers, self.fields) if self.fields is not None else dict(answers)
        return details(values, answers, result) if self.return_details else values


def project(answers: dict[str, Any], fields: list[Field]) -> dict[str, Any]:
    """Answers as schema values: a choice's enum value, a score's integer, a noul's bool; None if it abstained."""
    values: dict[str, Any] = {}
    for f in fields:
        answer = answers.get(f.name)
        if answer is None:
            continue
        if answer.get("low_confidence"):
            values[f.name] = None
            continue
        values[f.name] = QUESTION_TYPES.by_name(f.kind).schema.value(answer, f.reading)
    return values


def details(values: dict[str, Any], answers: dict[str, Any], result: dict[str, Any]) -> DecisionResult:
    confidence: dict[str, float] = {}
    answer_confidence: dict[str, float | None] = {}
    probabilities: dict[str, dict[str, Any]] = {}
    for name, answer in answers.items():
        confidence[name] = float(answer.get("confidence", 0.0))
        answer_confidence[name] = answer_confidence_value(answer)
        qtype = QUESTION_TYPES.find(answer.get("type"))
        if qtype is not None:
            probabilities[name] = qtype.schema.probabilities(answer)
        else:
            probabilities[name] = dict(answer.get("probabilities") or {})
    return DecisionResult(values=values, confidence=confidence, probabilities=probabilities, answers=dict(answers),
                          usage=result.get("usage"), routing=result.get("routing"),
                          answer_confidence=answer_confidence)
