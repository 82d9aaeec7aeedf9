"""client.decode against the official SDK: the same answer dicts and usage, value for value.

Two oracles: the SDK's whole `predict()` on the tiny checkpoint (our decode fed the SDK model's own
logits, taken from `Agent._forward` on the SDK's collated batch), and the SDK's `predict()` with its
forward replaced by arbitrary logits, which reaches the temperature buckets, ties and extreme values
a random model rarely produces. Equality is exact: no tolerance in the 4th decimal was needed.
"""
from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laya_pool.client.card import ModelCard
from laya_pool.client.decode import answer_confidence, decode_answers, temp_bucket
from laya_pool.client.semantics import encode_request
from laya_pool.protocol.qtypes import entropy_confidence

CASES_FILE = Path(__file__).parents[1] / "laya_pool" / "tools" / "cases" / "requests.json"
CASES = json.loads(CASES_FILE.read_text(encoding="utf-8"))["cases"]
CASE = {c["name"]: c for c in CASES}


@pytest.fixture(scope="module")
def card(tiny_ckpt) -> ModelCard:
    return ModelCard.from_dir(tiny_ckpt)


def sdk_outputs(agent, state, questions):
    """The SDK model's logits [R, K] and act probabilities [R, n_act] for this request."""
    from laya.common import collate_items

    ids = list(questions)
    internal = {qid: agent._to_internal(questions[qid]) for qid in ids}
    items = agent._encode_state(state, ids, internal)
    with torch.no_grad():
        logits, act = agent._forward(collate_items([items], agent.tok.pad_token_id))
    return logits, act, [len(it["markers"]) for it in items]


def flatten(logits: np.ndarray, ks: list[int]) -> np.ndarray:
    return np.concatenate([logits[j, :k] for j, k in enumerate(ks)]).astype(np.float32)


@contextmanager
def sdk_forward_returns(agent, logits: np.ndarray, act: np.ndarray):
    """Make the SDK's predict() run on these model outputs instead of its own forward."""
    def fake_forward(batch):
        assert batch["input_ids"].shape[0] == logits.shape[0]
        return logits, act
    with mock.patch.object(agent, "_forward", fake_forward):
        yield


@pytest.mark.parametrize("case", CASES, ids=[c["name"] for c in CASES])
def test_frozen_case_answers_equal_sdk_predict(card, sdk_agent, case):
    state, questions = case["state"], case["questions"]
    logits, act, ks = sdk_outputs(sdk_agent, state, questions)
    enc = encode_request(card, state, questions)
    ours = decode_answers(card, enc, flatten(logits, ks), act)
    theirs = sdk_agent.predict(state, questions)
    assert ours == theirs
    assert json.dumps(ours, sort_keys=True, default=str) == json.dumps(theirs, sort_keys=True, default=str)
    # same key order as well, for callers that print the dict
    assert list(ours["answers"]) == list(theirs["answers"]) and list(ours["usage"]) == list(theirs["usage"])
    for a, b in zip(ours["answers"].values(), theirs["answers"].values()):
        assert list(a) == list(b)


def test_answers_are_not_degenerate(card, sdk_agent):
    # a parity test on uniform answers would prove nothing
    case = CASE["json_state_three_types"]
    logits, act, ks = sdk_outputs(sdk_agent, case["state"], case["questions"])
    out = decode_answers(card, encode_request(card, case["state"], case["questions"]), flatten(logits, ks), act)
    probs = list(out["answers"]["team"]["probabilities"].values())
    assert max(probs) - min(probs) > 0.01


def _random_outputs(seed: int, ks: list[int], n_act: int, scale: float, ties: bool):
    rng = np.random.default_rng(seed)
    kmax = max(ks)
    logits = np.full((len(ks), kmax), -1e4, dtype=np.float32)
    for j, k in enumerate(ks):
        row = (rng.standard_normal(k) * scale).astype(np.float32)
        if ties and k > 1:
            row[rng.integers(0, k)] = row.max()
        logits[j, :k] = row
    act_logits = rng.standard_normal((len(ks), n_act)).astype(np.float32)
    act = torch.softmax(torch.from_numpy(act_logits), -1).numpy()
    return logits, act


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(sorted(CASE)), seed=st.integers(0, 2**32 - 1),
       scale=st.sampled_from([0.0, 1e-3, 1.0, 4.0, 30.0, 300.0]), ties=st.booleans())
def test_arbitrary_logits_equal_sdk_predict(card, sdk_agent, name, seed, scale, ties):
    case = CASE[name]
    enc = encode_request(card, case["state"], case["questions"])
    ks = [len(m) for _, m, _ in enc.rows]
    logits, act = _random_outputs(seed, ks, card.n_act, scale, ties)
    with sdk_forward_returns(sdk_agent, logits, act):
        theirs = sdk_agent.predict(case["state"], case["questions"])
    assert decode_answers(card, enc, flatten(logits, ks), act) == theirs


def test_temperature_buckets_are_applied(card, sdk_agent):
    # 30 options: the "choice:11+" bucket ships 0.1006 and both sides must apply the clamped 0.5
    case = CASE["thirty_options_capped"]
    enc = encode_request(card, case["state"], case["questions"])
    logits, act = _random_outputs(3, [30], card.n_act, 1.0, False)
    ours = decode_answers(card, enc, flatten(logits, [30]), act)
    z = logits[0] / 0.5
    p = np.exp(z - z.max())
    p /= p.sum()
    assert ours["answers"]["queue"]["answer_confidence"] == round(float(p.max()), 4)
    with sdk_forward_returns(sdk_agent, logits, act):
        assert ours == sdk_agent.predict(case["state"], case["questions"])


def test_int_labels_and_keys_survive(card, sdk_agent):
    questions = {7: {"type": "choice", "instructions": "pick", "criteria": [True, 2, 2.5, "x"]}}
    enc = encode_request(card, "state", questions)
    logits, act = _random_outputs(5, [4], card.n_act, 2.0, False)
    ours = decode_answers(card, enc, flatten(logits, [4]), act)
    assert set(ours["answers"][7]["probabilities"]) == {True, 2, 2.5, "x"}
    with sdk_forward_returns(sdk_agent, logits, act):
        assert ours == sdk_agent.predict("state", questions)


def test_empty_questions_equal_sdk(card, sdk_agent):
    enc = encode_request(card, "state", {})
    assert decode_answers(card, enc, np.zeros(0, np.float32), np.zeros((0, card.n_act), np.float32)) \
        == sdk_agent.predict("state", {})


def test_shape_mismatches_are_refused(card):
    enc = encode_request(card, "s", {"u": {"type": "noul", "instructions": "x"}})
    with pytest.raises(ValueError, match="logits"):
        decode_answers(card, enc, np.zeros(3, np.float32), np.ones((1, 2), np.float32))
    with pytest.raises(ValueError, match="act_probs"):
        decode_answers(card, enc, np.zeros(2, np.float32), np.ones((2, 2), np.float32))


@pytest.mark.parametrize("qtype", [0, 1, 2])
def test_temp_bucket_matches_sdk(qtype):
    from laya.common import temp_bucket as sdk_bucket

    for k in range(0, 300):
        assert temp_bucket(qtype, k) == sdk_bucket(qtype, k)


def test_confidences_match_sdk():
    from laya.common import answer_confidence as sdk_answer
    from laya.common import confidence_from_probs as sdk_entropy

    rng = np.random.default_rng(0)
    for k in [1, 2, 3, 7, 11, 64, 200]:
        for scale in [0.0, 1.0, 50.0]:
            z = (rng.standard_normal(k) * scale).astype(np.float32)
            p = np.exp(z - z.max())
            p /= p.sum()
            assert answer_confidence(p, k) == sdk_answer(p, k)
            assert entropy_confidence(p, k) == sdk_entropy(p, k)
