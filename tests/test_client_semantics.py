"""client.card / client.semantics against the official SDK: the same token rows, the same refusals.

The oracle is the installed `laya` SDK on the tiny checkpoint: `Agent._check_question` / `_to_internal`
/ `_encode_state` are exactly what `Agent.predict(state, questions)` feeds its model.
"""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laya_pool.client.card import CardError, ModelCard, clamp_temperature, directory_fingerprint
from laya_pool.client.semantics import QuestionError, encode_request, to_internal

CASES_FILE = Path(__file__).parents[1] / "laya_pool" / "tools" / "cases" / "requests.json"
CASES = json.loads(CASES_FILE.read_text(encoding="utf-8"))["cases"]


@pytest.fixture(scope="module")
def card(tiny_ckpt) -> ModelCard:
    return ModelCard.from_dir(tiny_ckpt)


def sdk_encode(agent, state, questions, **overrides):
    """What `Agent.predict` computes before its forward pass: (internal questions, items)."""
    ids = list(questions)
    for qid in ids:
        agent._check_question(qid, questions[qid])
    internal = {qid: agent._to_internal(questions[qid]) for qid in ids}
    return internal, agent._encode_state(state, ids, internal, **overrides)


def assert_same_rows(card, agent, state, questions, **overrides):
    """Ours equals the SDK's, row for row, or both refuse and name the same question."""
    try:
        internal, items = sdk_encode(agent, state, questions, **overrides)
    except ValueError as sdk_error:
        with pytest.raises(QuestionError) as ours:
            encode_request(card, state, questions, **overrides)
        sdk_msg, our_msg = str(sdk_error), str(ours.value)
        if sdk_msg.startswith("question "):
            prefix = sdk_msg.split(":", 1)[0]
            assert our_msg.startswith(prefix + ":"), (sdk_msg, our_msg)
        return None
    enc = encode_request(card, state, questions, **overrides)
    assert enc.qids == list(questions)
    assert enc.questions == [internal[q] for q in enc.qids]
    assert len(enc.rows) == len(items)
    for qid, (ids, markers, qtype), opt, stats, item in zip(enc.qids, enc.rows, enc.option_stats,
                                                           enc.state_stats, items):
        assert ids.dtype.name == "int32" and markers.dtype.name == "int32"
        assert ids.tolist() == item["ids"], qid
        assert markers.tolist() == item["markers"], qid
        assert qtype == item["qtype"], qid
        assert opt == item["options"], qid
        assert stats == item["state_stats"], qid
    return enc


# ---------------------------------------------------------------- the card


def test_card_matches_sdk_load(card, sdk_agent):
    tok = sdk_agent.tok
    assert (card.cls_id, card.sep_id, card.mask_id, card.pad_id) == (
        tok.cls_token_id, tok.sep_token_id, tok.mask_token_id, tok.pad_token_id)
    assert card.mask_token == tok.mask_token
    assert card.max_len == sdk_agent.cfg.get("max_len", 512)
    assert card.head_max_len == sdk_agent.cfg.get("head_max_len", 192)
    assert list(card.temperature) == sdk_agent.temperature
    assert card.temperature_by_options == sdk_agent.temperature_by_options
    # the generator ships out-of-range buckets on purpose: both sides must clamp them
    assert card.temperature_by_options["choice:11+"] == 0.5
    assert card.temperature_by_options["score:6-10"] == 5.0
    assert card.n_act == sdk_agent.model.act_head[-1].out_features
    assert card.vocab_size == 1024


def test_card_from_pool_card_equals_from_dir(card, tiny_ckpt):
    from laya_pool.worker.checkpoint import load_checkpoint

    ckpt = load_checkpoint(tiny_ckpt, with_tensors=False)
    pooled = ModelCard.from_card(ckpt.card())
    assert pooled.fingerprint == card.fingerprint == ckpt.fingerprint == directory_fingerprint(tiny_ckpt)
    for name in ("cls_id", "sep_id", "mask_id", "pad_id", "mask_token", "max_len", "head_max_len",
                 "temperature", "temperature_by_options", "n_act", "vocab_size"):
        assert getattr(pooled, name) == getattr(card, name), name
    case = CASES[1]
    a, b = encode_request(pooled, case["state"], case["questions"]), encode_request(card, case["state"],
                                                                                     case["questions"])
    assert [r[0].tolist() for r in a.rows] == [r[0].tolist() for r in b.rows]


def test_card_defaults_and_errors(tiny_ckpt):
    base = {
        "fingerprint": "x",
        "agent_config": {"encoder": "e", "head_layers": 2},
        "tokenizer_json": (tiny_ckpt / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"),
        "tokenizer_config": json.loads((tiny_ckpt / "tokenizer" / "tokenizer_config.json").read_text()),
        "vocab_size": 1024,
    }
    c = ModelCard.from_card(base)
    assert (c.max_len, c.head_max_len, c.temperature, c.n_act) == (512, 192, (1.0, 1.0, 1.0), 1)
    with pytest.raises(CardError, match="temperature"):
        ModelCard.from_card({**base, "agent_config": {"temperature": [1.0, 2.0]}})
    with pytest.raises(CardError, match="mask_token"):
        ModelCard.from_card({**base, "tokenizer_config": {**base["tokenizer_config"], "mask_token": "<nope>"}})
    with pytest.raises(CardError, match="tokenizer_json"):
        ModelCard.from_card({**base, "tokenizer_json": "{not json"})
    with pytest.raises(CardError):
        ModelCard.from_dir(tiny_ckpt / "missing")


@pytest.mark.parametrize("raw", [0.1006, 7.0, 1.25, 0.5, 5.0, -3, 0, True, False, None, "2.5", "x", [1.0],
                                 float("nan"), float("inf"), float("-inf"), 2])
def test_clamp_temperature_matches_sdk(raw):
    from laya.common import clamp_temperature as sdk_clamp

    assert clamp_temperature(raw) == sdk_clamp(raw)


def test_unconvertible_temperature_refuses_the_card(tiny_ckpt):
    from laya.common import clamp_temperature as sdk_clamp

    with pytest.raises(OverflowError):   # the SDK fails to load such a checkpoint
        sdk_clamp(10**400)
    card = {"agent_config": {"temperature": [1.0, 10**400, 1.0]},
            "tokenizer_json": (tiny_ckpt / "tokenizer" / "tokenizer.json").read_text(encoding="utf-8"),
            "tokenizer_config": json.loads((tiny_ckpt / "tokenizer" / "tokenizer_config.json").read_text())}
    with pytest.raises(CardError, match="temperature"):
        ModelCard.from_card(card)


# ---------------------------------------------------------------- the tokenizer


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(max_size=300) | st.lists(st.sampled_from(
    ["ticket", "refund", "Grüße", "東京", "🙂", "[MASK]", "[CLS]", "[SEP]", " ", "\n", "{\"a\": 1}", "level"]),
    max_size=120).map("".join))
def test_tokenizers_library_equals_sdk_fast_tokenizer(card, sdk_agent, text):
    tok = sdk_agent.tok
    ours = card.encode(text)
    assert ours == tok(text, add_special_tokens=False)["input_ids"]
    # the SDK caps an option at the tokenizer (truncation=True, max_length=48): the first 48 tokens
    assert ours[:48] == tok(text, add_special_tokens=False, truncation=True, max_length=48)["input_ids"]
    assert list(card.encode_question_text(text)) == ours


# ---------------------------------------------------------------- frozen cases


def test_enough_frozen_cases():
    assert len(CASES) >= 13
    assert len({c["name"] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_frozen_case_rows_equal_sdk(card, sdk_agent, case):
    enc = assert_same_rows(card, sdk_agent, case["state"], case["questions"])
    assert enc is not None and len(enc) == len(case["questions"])
    for qdef, q in zip(case["questions"].values(), enc.questions):
        assert q == sdk_agent._to_internal(qdef) == to_internal(qdef)


def test_frozen_cases_cover_what_they_claim(card):
    enc = {c["name"]: encode_request(card, c["state"], c["questions"]) for c in CASES}
    assert all(s["truncated"] for s in enc["long_text_right_cut"].state_stats)
    assert all(s["truncated"] for s in enc["long_conversation_left_cut"].state_stats)
    assert enc["thirty_options_capped"].option_stats[0]["tokens_per_option"] is not None
    collapsed = enc["thirty_options_collapsed"].option_stats[0]
    assert collapsed["options_distinct"] < collapsed["options"]
    assert max(len(r[0]) for r in enc["many_questions_long_state"].rows) == card.max_len
    assert all(card.mask_id not in r[0][r[1][-1] + 1:] for r in enc["mask_token_in_user_text"].rows)


def test_conversation_keeps_the_newest_turn(card):
    case = next(c for c in CASES if c["name"] == "long_conversation_left_cut")
    ids, _, _ = encode_request(card, case["state"], case["questions"]).rows[0]
    tail = card.encode(json.dumps(case["state"][-1], ensure_ascii=False) + "]")
    assert ids[-1] == card.sep_id and ids[-1 - len(tail):-1].tolist() == tail


# ---------------------------------------------------------------- overrides and edges


@pytest.mark.parametrize("max_len,head_max_len", [(64, 192), (128, 32), (512, 16), (40, 8), (256, 400), (30, 192)])
@pytest.mark.parametrize("name", ["json_state_three_types", "thirty_options_capped", "long_conversation_left_cut",
                                  "option_order", "score_ten_levels_and_list_labels"])
def test_budget_overrides_equal_sdk(card, sdk_agent, name, max_len, head_max_len):
    case = next(c for c in CASES if c["name"] == name)
    assert_same_rows(card, sdk_agent, case["state"], case["questions"], max_len=max_len, head_max_len=head_max_len)


def test_empty_questions_tokenize_nothing(card):
    enc = encode_request(card, "anything", {})
    assert enc.rows == [] and enc.n_tokens == 0


@pytest.mark.parametrize("state", [42, 3.5, True, ["a", {"b": None}], ("t", "u"), {"k": ["[MASK]"]}])
def test_other_json_states_equal_sdk(card, sdk_agent, state):
    assert_same_rows(card, sdk_agent, state, {"u": {"type": "noul", "instructions": "ok?"}})


def test_int_question_ids_and_labels(card, sdk_agent):
    questions = {7: {"type": "choice", "instructions": 12, "criteria": [True, 2, 2.5, "x"]},
                 "s": {"type": "score", "instructions": 1.5, "criteria": [{"a": 1}, "plain", 3]}}
    assert_same_rows(card, sdk_agent, "state", questions)


def test_type_errors_match_sdk(card, sdk_agent):
    with pytest.raises(TypeError):
        sdk_agent.predict(None, {"u": {"type": "noul", "instructions": "x"}})
    with pytest.raises(TypeError, match="state"):
        encode_request(card, None, {"u": {"type": "noul", "instructions": "x"}})
    with pytest.raises(TypeError):
        sdk_agent.predict("s", [("u", {})])
    with pytest.raises(TypeError, match="questions"):
        encode_request(card, "s", [("u", {})])


# ---------------------------------------------------------------- refusals

BAD_QUESTIONS = {
    "empty_instructions": {"type": "noul", "instructions": "   "},
    "none_instructions": {"type": "noul", "instructions": None},
    "no_instructions": {"type": "noul"},
    "empty_list_instructions": {"type": "noul", "instructions": []},
    "bytes_instructions": {"type": "noul", "instructions": b"x"},
    "unknown_type": {"type": "rank", "instructions": "x"},
    "missing_type": {"instructions": "x"},
    "not_a_dict": ["choice"],
    "choice_criteria_str": {"type": "choice", "instructions": "x", "criteria": "a,b"},
    "choice_criteria_empty": {"type": "choice", "instructions": "x", "criteria": {}},
    "choice_label_null": {"type": "choice", "instructions": "x", "criteria": ["a", None]},
    "choice_label_nested": {"type": "choice", "instructions": "x", "criteria": ["a", ["b"]]},
    "choice_duplicate_labels": {"type": "choice", "instructions": "x", "criteria": ["a", "b", "a"]},
    "choice_duplicate_numeric": {"type": "choice", "instructions": "x", "criteria": [1, 1.0]},
    "choice_duplicate_bool": {"type": "choice", "instructions": "x", "criteria": [True, 1]},
    "score_criteria_dict": {"type": "score", "instructions": "x", "criteria": {"0": "low"}},
    "score_empty": {"type": "score", "instructions": "x", "criteria": []},
    "score_null_level": {"type": "score", "instructions": "x", "criteria": ["a", None]},
    "noul_criteria_list": {"type": "noul", "instructions": "x", "criteria": ["no", "yes"]},
    "noul_criteria_bad_keys": {"type": "noul", "instructions": "x", "criteria": {"yes": "y"}},
    "order_short": {"type": "choice", "instructions": "x", "criteria": ["a", "b", "c"], "option_order": [0, 1]},
    "order_repeat": {"type": "choice", "instructions": "x", "criteria": ["a", "b"], "option_order": [0, 0]},
    "order_bool": {"type": "choice", "instructions": "x", "criteria": ["a", "b"], "option_order": [True, 0]},
    "order_str": {"type": "noul", "instructions": "x", "option_order": "10"},
    "order_none": {"type": "score", "instructions": "x", "criteria": ["a"], "option_order": None},
    "labels_on_choice": {"type": "choice", "instructions": "x", "criteria": ["a"], "labels": {}},
    "noul_labels_missing_true": {"type": "noul", "instructions": "x", "labels": {"false": "n"}},
    "noul_labels_same": {"type": "noul", "instructions": "x", "labels": {"false": "y ", "true": " y"}},
    "noul_labels_blank": {"type": "noul", "instructions": "x", "labels": {"false": "", "true": "y"}},
    "noul_labels_not_str": {"type": "noul", "instructions": "x", "labels": {"false": 0, "true": 1}},
    "noul_labels_list": {"type": "noul", "instructions": "x", "labels": ["n", "y"]},
}


@pytest.mark.parametrize("name", list(BAD_QUESTIONS))
def test_refusals_match_sdk(card, sdk_agent, name):
    questions = {"ok": {"type": "noul", "instructions": "fine"}, name: BAD_QUESTIONS[name]}
    with pytest.raises(ValueError) as sdk_error:
        sdk_encode(sdk_agent, "state", questions)
    with pytest.raises(QuestionError) as ours:
        encode_request(card, "state", questions)
    assert ours.value.qid == name and repr(name) in str(ours.value)
    assert repr(name) in str(sdk_error.value)


@pytest.mark.parametrize("qid", [None, "", "   ", 1.5, ("a",)])
def test_bad_question_ids_match_sdk(card, sdk_agent, qid):
    questions = {qid: {"type": "noul", "instructions": "x"}}
    with pytest.raises(ValueError):
        sdk_encode(sdk_agent, "s", questions)
    with pytest.raises(QuestionError, match="question id"):
        encode_request(card, "s", questions)


def test_too_many_options_for_max_len(card, sdk_agent):
    questions = {"ok": {"type": "noul", "instructions": "fine"},
                 "wide": {"type": "choice", "instructions": "x", "criteria": [f"option {i}" for i in range(80)]}}
    with pytest.raises(ValueError, match="option markers fit") as sdk_error:
        sdk_encode(sdk_agent, "s", questions, max_len=96)
    with pytest.raises(QuestionError, match="option markers fit") as ours:
        encode_request(card, "s", questions, max_len=96)
    assert ours.value.qid == "wide"
    assert str(ours.value).split(";")[0] == str(sdk_error.value).split(";")[0]


def test_validation_comes_before_tokenizing(card):
    # a non-JSON state would fail to serialize, so a refusal proves the state was never touched
    with pytest.raises(QuestionError):
        encode_request(card, {"x": object()}, {"bad": {"type": "noul", "instructions": ""}})
    with pytest.raises(TypeError):
        encode_request(card, {"x": object()}, {"good": {"type": "noul", "instructions": "x"}})


# ---------------------------------------------------------------- generated requests

_WORDS = ["ticket", "customer", "refund", "invoice", "urgent", "billing", "login", "error", "crash", "payment",
          "order", "the", "a", "not", "please", "Grüße", "Zürich", "東京", "返金", "Привет", "🙂", "€100",
          "[MASK]", "[CLS]", "[SEP]", "{", "\"", ":", "\n", "level", "question:"]


def _text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n))


words = st.builds(_text, st.integers(0, 2**20), st.sampled_from([1, 2, 4, 9, 30]))
short_text = words | st.text(min_size=1, max_size=20).filter(str.strip)
long_text = st.builds(_text, st.integers(0, 2**20), st.sampled_from([0, 3, 40, 300, 800]))
states = st.one_of(
    long_text,
    st.builds(lambda s, n, tags: {"subject": s, "n": n, "tags": tags}, long_text, st.integers(), st.lists(words)),
    st.lists(st.builds(lambda r, c: {"role": r, "content": c}, st.sampled_from(["user", "agent"]), long_text),
             max_size=12),
)
descriptions = st.one_of(st.none(), st.just(""), short_text, st.just(0), st.just(False),
                         st.builds(lambda d: {"desc": d, "n": 2}, short_text), st.lists(words, max_size=3))
instructions = st.one_of(short_text, st.builds(lambda d: {"task": d}, short_text))
blank_instructions = st.sampled_from(["", "  ", [], {}, None])
rarely = st.sampled_from([False] * 15 + [True])   # hypothesis favours 0 in st.integers; this stays rare
labels = st.one_of(words, st.integers(-5, 50))


@st.composite
def questions_strategy(draw):
    out = {}
    for i in range(draw(st.integers(1, 4))):
        t = draw(st.sampled_from(["choice", "choice", "score", "noul"]))
        # mostly valid: a request is refused as soon as one of its questions is
        q = {"type": t, "instructions": draw(blank_instructions if draw(rarely) else instructions)}
        if t == "choice":
            mode = draw(st.integers(0, 4))
            if mode < 2:
                q["criteria"] = draw(st.dictionaries(words, descriptions, min_size=1, max_size=35))
            elif mode < 4:
                q["criteria"] = draw(st.lists(labels, min_size=1, max_size=14, unique=True))
            else:   # many options with one long shared prefix: the head cap makes their spans collide
                prefix = draw(words)
                q["criteria"] = {f"{prefix} {prefix} option {i}": None for i in range(draw(st.integers(10, 40)))}
            n = len(q["criteria"])
        elif t == "score":
            q["criteria"] = draw(st.lists(descriptions.filter(lambda d: d is not None), min_size=1, max_size=12))
            n = len(q["criteria"])
        else:
            crit = draw(st.one_of(st.none(), st.dictionaries(st.sampled_from(["true", "false", "True", "FALSE"]),
                                                             descriptions, max_size=2)))
            if crit is not None:
                q["criteria"] = crit
            if draw(st.booleans()):
                q["labels"] = draw(st.fixed_dictionaries({"false": short_text, "true": short_text}))
            n = 2
        if draw(st.integers(0, 3)) == 0:
            q["option_order"] = draw(st.permutations(range(n)))
        out[draw(st.sampled_from([f"q{i}", f"Frage {i}", f"問{i}"]))] = q
    return out


budgets = st.one_of(st.just({}), st.fixed_dictionaries(
    {"max_len": st.sampled_from([48, 96, 200, 512]), "head_max_len": st.sampled_from([16, 64, 192, 300])}))


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(state=states, questions=questions_strategy(), budget=budgets)
def test_generated_requests_equal_sdk(card, sdk_agent, state, questions, budget):
    assert_same_rows(card, sdk_agent, state, questions, **budget)


def test_sanity_generated_inputs_hit_both_paths(card, sdk_agent):
    # the strategy must produce accepted requests, refusals and truncated states
    seen = {"ok": 0, "refused": 0, "truncated": 0}

    @settings(max_examples=40, deadline=None, database=None, derandomize=True)
    @given(state=states, questions=questions_strategy())
    def probe(state, questions):
        try:
            enc = encode_request(card, state, questions)
        except QuestionError:
            seen["refused"] += 1
            return
        seen["ok"] += 1
        seen["truncated"] += any(s["truncated"] for s in enc.state_stats)

    probe()
    assert seen["ok"] and seen["refused"] and seen["truncated"], seen
