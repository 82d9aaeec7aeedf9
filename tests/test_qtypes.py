"""A question type is one record of laya_pool/protocol/qtypes.py, and every room dispatches through the registry.

- the registry is the SDK's: the same names and ids (the checkpoint's `type_emb` / `temperature` index), the
  same option-count buckets;
- every dispatcher handles every registered type, walked with one example per type: validation, prompt
  rendering and encoding, the checkpoint's shapes, the worker's row check, decoding, abstention, window
  aggregation and the structured schema;
- a record missing a piece is refused when it is made;
- no module outside the registry compares a question type with a type name (an AST scan over laya_pool/).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open

from laya_pool.client import abstain, scan, structured
from laya_pool.client.card import ModelCard
from laya_pool.client.decode import decode_answers, temp_bucket
from laya_pool.client.semantics import QuestionError, check_question, encode_request, render_options, to_internal
from laya_pool.kernels.arch import parse_arch
from laya_pool.protocol import qtypes
from laya_pool.protocol.qtypes import QUESTION_TYPES, QuestionType, Registry, Schema, option_bucket
from laya_pool.worker.batch import Batch, Limits, RequestError, validate

ROOT = Path(__file__).resolve().parents[1]
REGISTRY = ROOT / "laya_pool" / "protocol" / "qtypes.py"

# One question per registered type, and a JSON-schema property that `decide` asks as that type.
EXAMPLES = {
    "choice": ({"type": "choice", "instructions": "Which team handles it?",
                "criteria": {"billing": "invoices and refunds", "tech": "", "sales": None}},
               {"enum": ["billing", "tech", "sales"]}),
    "score": ({"type": "score", "instructions": "How urgent is it?", "criteria": ["calm", "today", "now"]},
              {"type": "integer", "minimum": 1, "maximum": 3}),
    "noul": ({"type": "noul", "instructions": "Is a refund asked for?"}, {"type": "boolean"}),
}
STATE = "the customer was charged twice for the annual plan and wants the money back today"


@pytest.fixture(scope="module")
def card(tiny_ckpt) -> ModelCard:
    return ModelCard.from_dir(tiny_ckpt)


def test_the_registry_is_the_sdks():
    from laya import common, confidence

    assert {t.name: t.id for t in QUESTION_TYPES} == common.QTYPES == {"choice": 0, "score": 1, "noul": 2}
    assert len(QUESTION_TYPES) == len(common.QTYPES) and QUESTION_TYPES.names == tuple(common.QTYPES)
    assert QUESTION_TYPES.buckets() == confidence.bucket_keys()
    for t in QUESTION_TYPES:
        assert [option_bucket(t.name, k) for k in range(1, 40)] == [common.temp_bucket(t.id, k) for k in range(1, 40)]


def test_every_registered_type_has_an_example():
    # a new type is walked below only once it has an example here
    assert set(EXAMPLES) == set(QUESTION_TYPES.names)


@pytest.mark.parametrize("name", QUESTION_TYPES.names)
def test_validation_rendering_and_encoding_know_the_type(card, name):
    t = QUESTION_TYPES.by_name(name)
    question, _ = EXAMPLES[name]
    check_question("q", question)
    internal = to_internal(question)
    options = render_options(internal)
    assert options and all(isinstance(o, str) for o in options)
    assert t.fixed_options in (None, len(options))
    encoded = encode_request(card, STATE, {"q": question})
    ids, markers, qtype = encoded.rows[0]
    assert qtype == t.id and len(markers) == len(options)
    refused = pytest.raises(QuestionError, match="'labels' is only supported")
    with refused if t.labels is None else contextlib.nullcontext():
        check_question("q", {**question, "labels": {"false": "no", "true": "yes"}})


@pytest.mark.parametrize("name", QUESTION_TYPES.names)
def test_the_checkpoint_and_the_worker_know_the_type(tiny_ckpt, card, name):
    t = QUESTION_TYPES.by_name(name)
    arch = parse_arch(json.loads((tiny_ckpt / "rl_agent_config.json").read_text()),
                      json.loads((tiny_ckpt / "encoder" / "config.json").read_text()))
    shapes = arch.tensor_shapes()
    with safe_open(str(tiny_ckpt / "model.safetensors"), "numpy") as f:
        written = (f.get_slice("type_emb.weight").get_shape()[0], f.get_slice("temperature").get_shape()[0])
    assert t.id < shapes["type_emb.weight"][0] == shapes["temperature"][0] == len(card.temperature)
    assert written == (len(QUESTION_TYPES), len(QUESTION_TYPES))
    assert [temp_bucket(t.id, k) for k in (1, 2, 3, 6, 11)] == [f"{name}:{s}" for s in ("2", "2", "3-5", "6-10", "11+")]
    limits = Limits(vocab_size=card.vocab_size, max_len=64, max_tokens=64, max_rows=2, max_markers=8)
    row = (np.arange(5, 15, dtype=np.int32), np.array([1, 2], np.int32))
    validate(Batch.from_rows([(*row, t.id)]), limits)
    with pytest.raises(RequestError) as e:
        validate(Batch.from_rows([(*row, len(QUESTION_TYPES))]), limits)
    assert e.value.field == "types"


def _answers(card, question, seeds):
    """The decoded answer of `question` for a few different model outputs."""
    encoded = encode_request(card, STATE, {"q": question})
    out = []
    for seed in seeds:
        logits = np.random.default_rng(seed).normal(0, 2, encoded.n_markers).astype(np.float32)
        act = np.full((1, card.n_act), 1.0 / card.n_act, np.float32)
        out.append(decode_answers(card, encoded, logits, act)["answers"]["q"])
    return out


@pytest.mark.parametrize("name", QUESTION_TYPES.names)
def test_decoding_abstention_and_windows_know_the_type(card, name):
    t = QUESTION_TYPES.by_name(name)
    question, _ = EXAMPLES[name]
    answers = _answers(card, question, range(4))
    for a in answers:
        assert a["type"] == name and name in a and list(a)[-3:] == ["confidence", "answer_confidence", "action"]
        bucket = option_bucket(name, len(render_options(to_internal(question))))
        assert abstain.threshold_for(a, {bucket: 0.75, "default": 0.25}) == 0.75
    scores = [t.window_score(a) for a in answers]
    assert len(set(scores)) > 1, "the example's answers must differ for the window choice to mean anything"
    results = [{"answers": {"q": dict(a)}, "usage": {"input_tokens": 1}} for a in answers]
    merged = scan.aggregate_windows(results, {"q": name}, [0, 8, 16, 24], 16, 40)
    best = int(np.argmax(scores))
    assert merged["answers"]["q"]["window"]["index"] == best
    assert {k: v for k, v in merged["answers"]["q"].items() if k != "window"} == answers[best]


@pytest.mark.parametrize("name", QUESTION_TYPES.names)
def test_the_structured_schema_knows_the_type(card, name):
    t = QUESTION_TYPES.by_name(name)
    _, prop = EXAMPLES[name]
    fields = structured.plan_from_json_schema({"type": "object", "properties": {"f": prop}})
    assert [f.kind for f in fields] == [name]
    check_question("f", fields[0].question)
    answer = _answers(card, fields[0].question, [0])[0]
    value = structured.project({"f": answer}, fields)["f"]
    assert value is not None and value == t.schema.value(answer, fields[0].reading)
    details = structured.details({"f": value}, {"f": answer}, {"answers": {"f": answer}})
    assert details.probabilities["f"] == t.schema.probabilities(answer) and details.probabilities["f"]


def test_an_unknown_type_is_refused_as_the_sdk_refuses_it(sdk_agent):
    question = {"type": "poll", "instructions": "Which one?", "criteria": ["a", "b"]}
    with pytest.raises(ValueError) as sdk_error:
        sdk_agent._check_question("vote", question)
    with pytest.raises(QuestionError) as ours:
        check_question("vote", question)
    assert str(ours.value) == str(sdk_error.value)
    assert ours.value.qid == "vote" and "unknown type 'poll'" in str(ours.value)


# ---------------------------------------------------------------------------------------------- records

_RULES = [f.name for f in dataclasses.fields(QuestionType) if f.name not in ("name", "id", "fixed_options", "labels")]


@pytest.mark.parametrize("piece", _RULES)
def test_a_record_missing_a_piece_is_refused(piece):
    given = {f.name: getattr(qtypes.NOUL, f.name) for f in dataclasses.fields(QuestionType)}
    with pytest.raises(TypeError, match=piece):
        QuestionType(**{**given, piece: None})
    del given[piece]
    with pytest.raises(TypeError, match=piece):
        QuestionType(**given)


@pytest.mark.parametrize("piece", ["question", "value", "probabilities"])
def test_a_schema_missing_a_piece_is_refused(piece):
    with pytest.raises(TypeError, match=piece):
        dataclasses.replace(qtypes.NOUL.schema, **{piece: None})


def test_the_registry_refuses_ids_that_are_not_the_rows_and_shared_names():
    with pytest.raises(ValueError, match="ids must be 0..1"):
        Registry((qtypes.CHOICE, qtypes.NOUL))
    with pytest.raises(ValueError, match="own name"):
        Registry((qtypes.CHOICE, dataclasses.replace(qtypes.CHOICE, id=1)))
    twin = dataclasses.replace(qtypes.SCORE, name="rank", id=2,
                               schema=dataclasses.replace(qtypes.SCORE.schema, json_types=("integer",)))
    with pytest.raises(ValueError, match="JSON types"):
        Registry((qtypes.CHOICE, qtypes.SCORE, twin))
    assert isinstance(qtypes.NOUL.schema, Schema)


# ---------------------------------------------------------------------------------------------- one place

def _type_name_comparisons(path: Path, names: set[str]) -> list[str]:
    """Comparisons (==, !=, in, a `case`) of anything with a type name spelled as a string literal."""
    def names_a_type(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return isinstance(node.value, str) and node.value in names
        return isinstance(node, (ast.Tuple, ast.List, ast.Set)) and any(names_a_type(e) for e in node.elts)

    hits = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
        elif isinstance(node, ast.MatchValue):
            operands = [node.value]
        else:
            continue
        if any(names_a_type(o) for o in operands):
            hits.append(f"{path.name}:{node.lineno}")
    return hits


def test_no_module_outside_the_registry_compares_a_type_with_its_name():
    files = [p for p in sorted((ROOT / "laya_pool").rglob("*.py")) if p != REGISTRY]
    hits = [hit for p in files for hit in _type_name_comparisons(p, set(QUESTION_TYPES.names))]
    assert len(files) > 50 and hits == []


def test_the_scan_finds_a_planted_comparison(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def answer(q, t, a):\n"
        "    if q['t'] == 'noul':\n"
        "        return 1\n"
        "    if t in ('choice', 'score'):\n"
        "        return 2\n"
        "    match a:\n"
        "        case 'score':\n"
        "            return 3\n"
        "    return t != 'rank' and q['type']\n")
    assert _type_name_comparisons(planted, set(QUESTION_TYPES.names)) == ["planted.py:2", "planted.py:4",
                                                                         "planted.py:7"]
