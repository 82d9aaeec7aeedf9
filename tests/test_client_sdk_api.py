"""The SDK's inference API on the client, against the installed SDK on the tiny checkpoint.

The pure parts first (client/abstain.py, client/structured.py, client/scan.py, client/batching.py, the
card's decode and the language temperatures: each against the SDK function it ports, no pool), then every
method of `Client` and `AsyncClient` (`predict` with its options, `system_one`, `predict_batch`,
`predict_long`, `decide`, `decide_batch`) against the same `laya.Agent` method, through a real pool.
Answers must be the SDK's dicts within the suite's tolerance (`assert_answers_close`: 2e-4 on numbers).
"""
from __future__ import annotations

import asyncio
import copy
import enum
import json
import math
import warnings
from dataclasses import asdict
from typing import Literal, Optional

import numpy as np
import pytest
from conftest import assert_answers_close

from laya_pool.client import abstain, batching, scan, structured
from laya_pool.client.card import ModelCard
from laya_pool.client.decode import resolve_lang_temperatures
from laya_pool.client.local import local_pool
from laya_pool.client.pool_async import AsyncClient
from laya_pool.client.semantics import to_internal
from laya_pool.protocol.wire import Cmd

pytestmark = pytest.mark.timeout(240)

TEAM = {"type": "choice", "instructions": "Which team handles this ticket?",
        "criteria": {"it": "hardware and software problems", "hr": "people matters", "sales": "deals"}}
URGENT = {"type": "noul", "instructions": "Is this urgent?"}
SEVERITY = {"type": "score", "instructions": "How severe is it?", "criteria": ["minor", "major", "critical"]}
QUESTIONS = {"team": TEAM, "urgent": URGENT, "severity": SEVERITY}
STATES = [
    "the printer on floor 3 is broken and nobody can print the quarterly report",
    {"ticket": 4411, "text": "please refund order 99, it arrived broken", "customer": "vip"},
    [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "how can I help?"},
     {"role": "user", "content": "cancel my plan today"}],
    "word " * 700,                       # longer than a row: truncated, usage says so
    "the invoice total is wrong, I was charged twice",
    {"text": "my password reset link expired"},
    "x",
]
LONG_TEXT = " ".join(f"sentence {i} about the order, the refund and the broken printer." for i in range(60))
LONG_CHAT = [{"role": "user", "content": f"message {i}: where is my parcel? it is late again."} for i in range(40)]
LANGS = {"de": {"temperature": [2.0, 0.7, 3.0], "temperature_by_options": {"choice:3-5": 4.0}},
         "fr-CA": {"temperature_by_options": {"noul:2": 0.6}}}

MAX_ROWS = 7                             # the pool's rows per request: 2 states of 3 questions per request


class Dept(enum.Enum):
    billing = "billing"
    support = "support"
    sales = "sales"


def _pydantic_model():
    pydantic = pytest.importorskip("pydantic")

    class Ticket(pydantic.BaseModel):
        department: Literal["billing", "support", "sales"]
        urgency: Literal[0, 1, 2]
        needs_human: bool
        dept: Dept
        priority: Optional[int] = pydantic.Field(default=None, ge=1, le=4)
        escalate: Optional[bool] = pydantic.Field(default=None, description="Should a manager see this?")
    return Ticket


JSON_SCHEMA = {"type": "object", "properties": {
    "department": {"enum": ["billing", "support", "sales"], "description": "Which department?"},
    "level": {"type": "integer", "minimum": 2, "maximum": 5},
    "spam": {"type": "boolean"},
    "flag": {"enum": [True, False]},
    "kind": {"$ref": "#/$defs/Kind", "description": "What kind of message?"},
    "maybe": {"anyOf": [{"enum": ["a", "b", None]}, {"type": "null"}]},
    "const": {"const": 7},
}, "$defs": {"Kind": {"enum": ["question", "complaint"], "description": "ignored"}}}

BAD_SCHEMAS = [
    "not a schema", {"type": "array"}, {"properties": {}}, {"properties": {"s": {"type": "string"}}},
    {"properties": {"a": {"type": "array"}}}, {"properties": {"o": {"type": "object"}}},
    {"properties": {"n": {"type": "integer"}}}, {"properties": {"n": {"type": "integer", "minimum": 0, "maximum": 20}}},
    {"properties": {"n": {"type": "integer", "minimum": True, "maximum": 3}}},
    {"properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}},
    {"properties": {"e": {"enum": "abc"}}}, {"properties": {"e": {"enum": []}}},
    {"properties": {"e": {"enum": [1, "1"]}}}, {"properties": {"e": {"enum": list(range(40))}}},
    {"properties": {"r": {"$ref": "#/$defs/Missing"}}},
    {"properties": {"r": {"$ref": "#/$defs/A"}}, "$defs": {"A": {"$ref": "#/$defs/A"}}},
    {"properties": {"u": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}},
    {"properties": {"t": {"type": ["integer", "boolean"]}}}, {"properties": {"x": 3}},
    {"properties": {f"p{i}": {"type": "boolean"} for i in range(40)}},
]


@pytest.fixture(scope="module")
def card(tiny_ckpt) -> ModelCard:
    return ModelCard.from_dir(tiny_ckpt)


@pytest.fixture(scope="module")
def sdk_answers(sdk_agent):
    """Real SDK results, ungated: what the gate and the projections are tried on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return sdk_agent.predict_batch(STATES, QUESTIONS)


def outcome(fn, *args, **kwargs):
    """The value, or the exception's type name and message: what two implementations must agree on."""
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = fn(*args, **kwargs)
    except Exception as e:                          # noqa: BLE001 - the point is to compare whatever it is
        return ("raised", type(e).__name__, str(e))
    return value, [str(w.message) for w in caught]


# ================================================================ pure parts against the SDK's functions


@pytest.mark.parametrize("value", [0.5, 0, 1, 1.0, 0.0001, 1.0001, -0.1, True, False, float("nan"), float("inf"),
                                   "0.5", [0.5], {"choice:2": 0.3}, {"default": 0.5, "noul:2": 0.9},
                                   {}, {"choice:1": 0.5}, {"noul:2": True}, {3: 0.1}, {"score:11+": 2}])
def test_min_confidence_check_matches_sdk(value):
    from laya.confidence import check_min_confidence
    ours, theirs = outcome(abstain.check_min_confidence, value), outcome(check_min_confidence, value)
    assert ours == theirs


def test_gate_matches_sdk(sdk_answers):
    from laya.confidence import apply_confidence_gate
    odd = copy.deepcopy(sdk_answers[0])       # answers the gate cannot read, and one already flagged
    odd["answers"]["team"].pop("answer_confidence")
    odd["answers"]["urgent"]["answer_confidence"] = float("nan")
    odd["answers"]["urgent"]["confidence"] = float("nan")
    odd["answers"]["severity"]["low_confidence"] = True
    results = [*sdk_answers, odd]
    for threshold in (None, 0.0, 0.4, 0.7, 1.0, {"choice:3-5": 0.9, "default": 0.2}, {"noul:2": 0.95}):
        ours, theirs = copy.deepcopy(results), copy.deepcopy(results)
        abstain.apply_confidence_gate(ours, threshold)
        apply_confidence_gate(theirs, threshold)
        assert json.dumps(ours) == json.dumps(theirs), threshold
    gated = copy.deepcopy(results)
    abstain.apply_confidence_gate(gated, 0.4)
    states = {a["abstention"] for r in gated for a in r["answers"].values()}
    assert states == {"passed", "abstained", "unevaluated"}          # the cases above reach every state


def test_schema_plans_match_sdk():
    from laya import structured as sdk
    schemas = [JSON_SCHEMA, _pydantic_model(), *BAD_SCHEMAS]
    for schema in schemas:
        ours = outcome(lambda s: structured.questions_from_json_schema(structured.schema_of(s)), schema)
        theirs = outcome(lambda s: sdk.questions_from_json_schema(sdk._schema_of(s)), schema)
        assert ours == theirs, schema
    assert outcome(structured.schema_of, 3) == outcome(sdk._schema_of, 3)
    planned = structured.questions_from_json_schema(JSON_SCHEMA)
    assert [q["type"] for q in planned.values()] == ["choice", "score", "noul", "noul", "choice", "choice", "choice"]


def test_projection_matches_sdk(sdk_agent):
    from laya import structured as sdk
    questions = structured.questions_from_json_schema(JSON_SCHEMA)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        results = sdk_agent.predict_batch(STATES[:3], questions, min_confidence=0.5)
    fields = structured.plan_from_json_schema(JSON_SCHEMA)
    for r in results:
        assert structured.project(r["answers"], fields) == sdk.answers_to_json(r["answers"], JSON_SCHEMA)
        assert asdict(structured.details({}, r["answers"], r)) == asdict(sdk._details({}, r["answers"], r))
    assert any(v is None for r in results for v in structured.project(r["answers"], fields).values())


def _internal(questions):
    return [to_internal(q) for q in questions.values()]


def _options(n: int) -> dict:
    return {"type": "choice", "instructions": "pick the best label for this text",
            "criteria": {f"label number {i}": f"the text is about topic {i} and nothing else" for i in range(n)}}


@pytest.mark.parametrize("questions", [QUESTIONS, {}, {"many": _options(12)}, {"huge": _options(30)},
                                       {"a": _options(4), "b": _options(9)}])
@pytest.mark.parametrize("window,stride", [(None, None), (100, None), (100, 50), (100, 100), (100, 101),
                                           (10_000, None), (10_000, 9_000), (64, 10), (0, 0)])
def test_window_budget_matches_sdk(card, sdk_agent, questions, window, stride):
    from laya.common import window_budget
    internal = _internal(questions)
    for max_len, head in ((512, 192), (300, 250), (128, 64)):
        ours = outcome(scan.window_budget, card, internal, max_len, head, window, stride)
        theirs = outcome(window_budget, sdk_agent.tok, internal, max_len, head, window, stride)
        assert ours == theirs, (max_len, head)


def test_window_batch_cap_matches_sdk():
    from laya.common import window_batch_cap
    for n in (1, 5, 38, 400):
        for window in (23, 100, 156, 312, 400):
            for budget in (64, 312):
                for batch_size in (None, 0, 3):
                    assert scan.window_batch_cap(n, window, budget, batch_size) == window_batch_cap(
                        n, window, budget, batch_size), (n, window, budget, batch_size)


def test_card_decode_matches_sdk_tokenizer(card, sdk_agent):
    text = f"[CLS] {LONG_TEXT} [MASK] naïve café — ünïcode 🙂 tabs\tand\nnewlines [SEP] {json.dumps(STATES[1])}"
    ids = card.encode(text)
    rng = np.random.default_rng(0)
    for _ in range(200):
        i, j = sorted(int(x) for x in rng.integers(0, len(ids), 2))
        assert card.decode(ids[i:j]) == sdk_agent.tok.decode(ids[i:j])


def test_lang_temperatures_match_sdk(card):
    from laya.common import resolve_lang_temperatures as sdk_resolve
    base = card.config["temperature"]
    for raw in (LANGS, None, {}, {"de": None}, {"de": {"temperature": [99, 0.01, True]}}, {3: {}}, {"de": 2},
                {"de": {"temperature": 2}}, {"de": {"temperature_by_options": [1]}},
                {"de": {"temperature_by_options": {"choice:2": "x"}}}):
        assert outcome(resolve_lang_temperatures, raw, base) == outcome(sdk_resolve, raw, base), raw


CALIBRATION = {"version": 2, "temperature": [2.0, 0.7, 1.5], "temperature_by_options": {"choice:3-5": 3.0},
               "binning_map": {"choice:3-5": {"bins": 4, "values": [0.1, 0.3, 0.6, 0.9]},
                               "noul:2": {"bins": 2, "values": [0.25, 0.75]}}}
BAD_CALIBRATIONS = [
    [], {"temperature": [1, 2]}, {"temperature": "abc"}, {"version": 1.5, "temperature": [1, 1, 1]},
    {"version": "x", "temperature": [1, 1, 1]}, {"version": True, "temperature": [1, 1, 1]},
    {"temperature": [1, 1, 1], "temperature_by_options": [1]}, {"temperature": [1, 1, 1], "binning_map": [1]},
    {"temperature": [1, 1, 1], "binning_map": {"noul:2": 3}}, {"temperature": [1, 1, 1], "binning_map": {"noul:2": {}}},
    {"temperature": [1, 1, 1], "binning_map": {"noul:2": {"bins": 2, "values": [0.5]}}},
    {"temperature": [1, 1, 1], "binning_map": {"noul:2": {"bins": 1, "values": [1.5]}}},
    {"temperature": [1, 1, 1], "binning_map": {"noul:2": {"bins": 1, "values": [True]}}},
    {"temperature": [1, 1, 1], "binning_map": {"noul:2": {"bins": 1, "values": ["nan"]}}},
    {"temperature": [99, 0.01, True], "temperature_by_options": {"noul:2": "x"}},          # clamped, with a warning
    {"temperature": [1, 2, 3], "temperature_by_options": None, "binning_map": {}},
]


def test_calibration_files_read_as_sdk():
    from types import SimpleNamespace

    from laya.calibrate import apply_calibration_payload

    from laya_pool.client.calibration import load_calibration

    def sdk(payload):
        agent = SimpleNamespace(model_id_or_path=None, subfolder=None, cfg=None)
        apply_calibration_payload(agent, payload)
        return (tuple(agent.temperature), agent.temperature_by_options, agent.binning_map)

    def ours(payload):
        c = load_calibration(payload)
        return (c.temperature, c.temperature_by_options, c.binning_map)
    for payload in [{**CALIBRATION, "version": 1}, *BAD_CALIBRATIONS]:
        assert outcome(ours, payload) == outcome(sdk, payload), payload


def test_pack_keeps_states_whole_and_within_capacity():
    sizes = [(3, 100, 9), (3, 90, 9), (3, 400, 9), (1, 10, 2), (8, 50, 20), (2, 20, 4)]
    cap = {"max_rows": 7, "max_tokens": 500, "max_markers": 30}
    chunks = batching.pack(sizes, cap)
    assert [i for c in chunks for i in c] == list(range(len(sizes)))          # every state once, in order
    assert chunks == [[0, 1], [2, 3], [4], [5]]                                # state 4 alone exceeds max_rows
    for c in chunks:
        if len(c) > 1:
            assert all(sum(sizes[i][k] for i in c) <= limit for k, limit in enumerate(cap.values()))
    assert batching.pack(sizes, {}) == [list(range(6))]                        # no capacity known: one request
    assert batching.pack(sizes, {}, batch_size=4) == [[0, 1, 2, 3], [4, 5]]
    assert batching.pack([], cap) == []
    flat, act = np.arange(7, dtype=np.float32), np.arange(6, dtype=np.float32).reshape(3, 2)
    parts = batching.split_outputs(flat, act, [3, 4], [1, 2])
    assert [p[0].tolist() for p in parts] == [[0, 1, 2], [3, 4, 5, 6]] and parts[1][1].shape == (2, 2)
    with pytest.raises(ValueError, match="7 logits"):
        batching.split_outputs(flat, act, [3, 3], [1, 2])


def test_the_harness_catches_a_planted_difference(sdk_answers):
    want = sdk_answers[0]
    assert_answers_close(want, copy.deepcopy(want))
    for plant in (lambda r: r["answers"]["team"]["probabilities"].__setitem__("it", 0.5),
                  lambda r: r["answers"]["urgent"].__setitem__("noul", r["answers"]["urgent"]["noul"] + 3e-4),
                  lambda r: r["usage"].__setitem__("state_tokens", 1 + r["usage"]["state_tokens"]),
                  lambda r: r["answers"]["team"].pop("action"),
                  lambda r: r["answers"].__setitem__("team", r["answers"].pop("team")),       # key order
                  lambda r: r["usage"].__setitem__("truncated", 1)):                          # a bool is not 1
        planted = copy.deepcopy(want)
        plant(planted)
        with pytest.raises(AssertionError):
            assert_answers_close(want, planted)


# ================================================================ the client's methods against the SDK's, via a pool


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    with local_pool(tiny_ckpt, "cpu", extra_args=["--threads", "1", "--max-rows", str(MAX_ROWS)]) as p:
        yield p


@pytest.fixture(scope="module")
def client(pool):
    with pool.client(timeout=60, lang_temperatures=LANGS) as c:
        yield c


@pytest.fixture
def sdk(sdk_agent, card, monkeypatch):
    """The SDK agent as `laya.load(dir, lang_temperatures=LANGS)` would build it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from laya.common import resolve_lang_temperatures as sdk_resolve
        monkeypatch.setattr(sdk_agent, "lang_temperatures", sdk_resolve(LANGS, sdk_agent.temperature_raw))
    return sdk_agent


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args, **kwargs)


def run_async(pool, method: str, *args, **kwargs):
    async def go():
        async with AsyncClient(pool.endpoint, timeout=60, lang_temperatures=LANGS) as c:
            return await getattr(c, method)(*args, **kwargs)
    return asyncio.run(go())


def count_requests(client, monkeypatch) -> list[int]:
    """Spy on the client's requests: one entry for every request it builds (each is sent once: no retries here)."""
    sent: list[int] = []
    build = client._request_frames

    def spy(*args, **kwargs):
        sent.append(1)
        return build(*args, **kwargs)
    monkeypatch.setattr(client, "_request_frames", spy)
    return sent


PREDICT_OPTIONS = [{}, {"lang": "de"}, {"lang": "fr-CA"}, {"lang": "es"}, {"min_confidence": 0.6},
                   {"min_confidence": {"choice:3-5": 0.5, "default": 0.9}, "lang": "de-AT"},
                   {"max_len": 64, "head_max_len": 40}, {"head_max_len": 24}]


@pytest.mark.parametrize("options", PREDICT_OPTIONS, ids=[json.dumps(o) for o in PREDICT_OPTIONS])
def test_predict_with_sdk_options_equals_sdk(client, sdk, options):
    for state in STATES[:4]:
        want = quiet(sdk.predict, state, QUESTIONS, **options)
        assert_answers_close(want, client.predict(state, QUESTIONS, **options))
    assert_answers_close(quiet(sdk.system_one, STATES[0], QUESTIONS, "de"),
                         client.system_one(STATES[0], QUESTIONS, "de"))


@pytest.fixture
def calibrated(pool, sdk, tmp_path, monkeypatch):
    """A calibration file loaded by the SDK agent (undone after the test) and a client given the same file."""
    path = tmp_path / "calibration.json"
    config = {k: v for k, v in sdk.cfg.items() if k not in ("temperature", "temperature_by_options")}
    path.write_text(json.dumps({**CALIBRATION, "config": config}))
    for name in ("temperature", "temperature_raw", "temperature_by_options", "temperature_by_options_raw",
                 "binning_map"):
        monkeypatch.setattr(sdk, name, getattr(sdk, name))
    quiet(sdk.load_calibration, str(path))        # it warns: the file records no model path
    with pool.client(timeout=60, lang_temperatures=LANGS, calibration=path) as c:
        yield sdk, c


def test_calibration_file_equals_sdk(calibrated, client):
    sdk, c = calibrated
    for options in ({}, {"lang": "de"}, {"min_confidence": 0.5}):
        for want, have in zip(quiet(sdk.predict_batch, STATES[:4], QUESTIONS, **options),
                              c.predict_batch(STATES[:4], QUESTIONS, **options), strict=True):
            assert_answers_close(want, have)
    binned = c.predict(STATES[0], QUESTIONS)["answers"]
    assert binned["team"]["answer_confidence"] in CALIBRATION["binning_map"]["choice:3-5"]["values"]
    assert binned != client.predict(STATES[0], QUESTIONS)["answers"]       # the file changed the answers
    async def other_checkpoint():
        async with AsyncClient(c.endpoint, calibration={**CALIBRATION, "config": {"other": 1}}) as other:
            return await other.predict(STATES[0], QUESTIONS)
    with pytest.warns(UserWarning, match="config differs"):
        assert_answers_close(binned, asyncio.run(other_checkpoint())["answers"])


def test_a_blocking_predict_batch_keeps_its_requests_in_flight_together(tiny_ckpt):
    """Client.predict_batch's requests go out together (as AsyncClient's do), so a worker merges them: sent one
    after another, each would find the worker idle and run alone (merged_requests stays 0)."""
    from conftest import wait_until
    states = (STATES * 3)[:16]
    with local_pool(tiny_ckpt, "cpu", extra_args=["--threads", "1", "--max-batch", "8"]) as p, \
            p.client(timeout=60) as c:
        alone = [c.predict(s, QUESTIONS) for s in states]
        together = c.predict_batch(states, QUESTIONS, batch_size=1)
        for want, have in zip(alone, together, strict=True):
            assert_answers_close(want, have)

        def merged() -> int:
            stats = c.status()["workers"][0].get("stats") or {}
            return stats.get("merged_requests", 0) if stats.get("ok", 0) >= 2 * len(states) else 0
        assert wait_until(merged, 10, lambda: f"no merged requests: {c.status()['workers'][0].get('stats')}") > 1


def test_batches_from_several_threads_on_one_client_take_turns(pool):
    """Client is thread-safe: a batch's requests out together must not lose their replies to another thread's
    batch on the same socket (with no retries, a dropped reply is a failed call)."""
    import threading
    states = (STATES * 2)[:8]
    with pool.client(timeout=20, retries=0) as c:
        want = c.predict_batch(states, QUESTIONS, batch_size=1)
        got, errors = {}, []

        def run(i: int) -> None:
            try:
                got[i] = [c.predict_batch(states, QUESTIONS, batch_size=1) for _ in range(3)]
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))
        threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert not errors, errors[:2]
    for batches in got.values():
        for batch in batches:
            for w, h in zip(want, batch, strict=True):
                assert_answers_close(w, h)


def test_lang_changes_answers(client):
    # otherwise the lang tests above would pass with `lang` ignored
    plain, german = client.predict(STATES[0], QUESTIONS), client.predict(STATES[0], QUESTIONS, lang="de")
    assert plain["answers"]["team"]["probabilities"] != german["answers"]["team"]["probabilities"]


def test_predict_batch_equals_sdk_in_shared_requests(client, sdk, monkeypatch):
    sent = count_requests(client, monkeypatch)
    got = client.predict_batch(STATES, QUESTIONS, lang="de", min_confidence=0.5)
    for want, have in zip(quiet(sdk.predict_batch, STATES, QUESTIONS, lang="de", min_confidence=0.5), got, strict=True):
        assert_answers_close(want, have)
    # 3 rows a state, 7 rows a request: 2 states per request
    assert len(sent) == math.ceil(len(STATES) / (MAX_ROWS // len(QUESTIONS)))
    sent.clear()
    got = client.predict_batch(STATES[:3], QUESTIONS, batch_size=1)
    assert len(sent) == 3
    for want, have in zip(quiet(sdk.predict_batch, STATES[:3], QUESTIONS, batch_size=1), got, strict=True):
        assert_answers_close(want, have)
    sent.clear()
    assert client.predict_batch([], QUESTIONS) == sdk.predict_batch([], QUESTIONS) == []
    assert client.predict_batch(STATES[:2], {}) == sdk.predict_batch(STATES[:2], {})
    assert sent == []                          # nothing to ask: no request


def test_predict_batch_without_known_capacity_stays_within_the_frame_limit(client, sdk, monkeypatch):
    client.describe()
    monkeypatch.setattr(client, "capacity", {})                  # as after a describe with no worker ready
    monkeypatch.setattr(client, "max_frame_bytes", 20 * 200)     # 200 tokens a request
    sent = count_requests(client, monkeypatch)
    states = [state for state in STATES if state is not STATES[3]]
    got = client.predict_batch(states, {"urgent": URGENT})
    for want, have in zip(quiet(sdk.predict_batch, states, {"urgent": URGENT}), got, strict=True):
        assert_answers_close(want, have)
    assert 1 < len(sent) < len(states)


def test_predict_long_equals_sdk(client, sdk):
    cases = [(LONG_TEXT, QUESTIONS, {}), (LONG_TEXT, {"urgent": URGENT}, {"window": 60, "stride": 45}),
             (LONG_CHAT, {"team": TEAM}, {"lang": "de", "batch_size": 3}), (LONG_CHAT, QUESTIONS, {}),
             (STATES[0], QUESTIONS, {}),
             (LONG_TEXT, {"huge": _options(30)}, {}), (LONG_TEXT, {}, {})]
    windows = []
    for state, questions, options in cases:
        want = quiet(sdk.predict_long, state, questions, **options)
        have = quiet(client.predict_long, state, questions, **options)
        assert_answers_close(want, have)
        windows.append(have["usage"]["windows"])
    assert windows[0] > 2 and windows[4] == 1        # the long ones were scanned, the short one read whole


def test_predict_long_warns_and_refuses_as_sdk(client, sdk):
    with pytest.warns(RuntimeWarning, match="window=10000 is wider"):
        client.predict_long(LONG_TEXT, {"urgent": URGENT}, window=10_000)
    for kwargs in ({"window": 100, "stride": 150}, {"aggregate": "max"}):
        with pytest.raises(ValueError) as ours:
            client.predict_long(LONG_TEXT, QUESTIONS, **kwargs)
        with pytest.raises(ValueError) as theirs:
            sdk.predict_long(LONG_TEXT, QUESTIONS, **kwargs)
        assert str(ours.value) == str(theirs.value)


def test_decide_equals_sdk(client, sdk):
    model = _pydantic_model()
    configs = ((JSON_SCHEMA, None, {}), (model, None, {"min_confidence": 0.55}), (None, QUESTIONS, {"lang": "de"}),
               (model, None, {"max_len": 96, "head_max_len": 48}))
    for i, (schema, questions, options) in enumerate(configs):
        details = {"return_details": i % 2 == 1}
        for state in STATES[:3]:
            _same_decision(quiet(sdk.decide, state, schema, questions=questions, **details, **options),
                           client.decide(state, schema, questions=questions, **details, **options))
        short = [state for state in STATES if state is not STATES[3]]          # the long one costs, proves nothing here
        want = quiet(sdk.decide_batch, short, schema, questions=questions, **details, **options)
        have = client.decide_batch(short, schema, questions=questions, **details, **options)
        assert len(want) == len(have) == len(short)
        for w, h in zip(want, have):
            _same_decision(w, h)


def test_sdk_decide_functions_take_a_client(client, sdk):
    import laya
    for state in STATES[:2]:
        assert laya.decide(client, state, JSON_SCHEMA, min_confidence=0.5) == client.decide(state, JSON_SCHEMA,
                                                                                           min_confidence=0.5)
    assert laya.decide_batch(client, STATES, JSON_SCHEMA) == client.decide_batch(STATES, JSON_SCHEMA)


def _same_decision(want, have):
    if return_details := not isinstance(want, dict):
        assert type(have).__name__ == "DecisionResult"
        want, have = asdict(want), asdict(have)
    assert_answers_close(want, have, path="details" if return_details else "values")


def test_errors_match_sdk(client, sdk):
    calls = [("predict_batch", ("a state", QUESTIONS), {}), ("predict_batch", ([STATES[0], None], QUESTIONS), {}),
             ("predict_batch", (STATES, [("q", URGENT)]), {}),
             ("predict", (STATES[0], QUESTIONS), {"min_confidence": 2}),
             ("predict", (None, QUESTIONS), {}),
             ("predict_long", (None, QUESTIONS), {}), ("predict_long", (LONG_TEXT, {"huge": _options(130)}), {}),
             ("decide", (STATES[0],), {}), ("decide", (STATES[0], JSON_SCHEMA), {"questions": QUESTIONS}),
             ("decide", (STATES[0], {"properties": {"s": {"type": "string"}}}), {}),
             ("decide", (STATES[0], JSON_SCHEMA), {"min_confidence": -1}),
             ("decide_batch", ("one state", JSON_SCHEMA), {}), ("decide_batch", (STATES, None), {})]
    for name, args, kwargs in calls:
        ours, theirs = outcome(getattr(client, name), *args, **kwargs), outcome(getattr(sdk, name), *args, **kwargs)
        assert ours[0] == "raised" and ours == theirs, name


def test_predict_long_names_what_is_wrong_with_the_state(client, pool):
    for state, error, where in ((LONG_TEXT + "\udc80", ValueError, "lone surrogate"),
                                ({"a": LONG_TEXT, "b": b"raw"}, TypeError, r"state\['b'\] is bytes")):
        with pytest.raises(error, match=where):
            client.predict_long(state, {"urgent": URGENT})
        with pytest.raises(error, match=where):
            run_async(pool, "predict_long", state, {"urgent": URGENT})


def test_async_client_equals_sdk(pool, sdk):
    want = quiet(sdk.predict, STATES[1], QUESTIONS, lang="de", min_confidence=0.5)
    assert_answers_close(want, run_async(pool, "predict", STATES[1], QUESTIONS, lang="de", min_confidence=0.5))
    assert_answers_close(want, run_async(pool, "system_one", STATES[1], QUESTIONS, "de", min_confidence=0.5))
    for w, h in zip(quiet(sdk.predict_batch, STATES, QUESTIONS), run_async(pool, "predict_batch", STATES, QUESTIONS),
                    strict=True):
        assert_answers_close(w, h)
    assert_answers_close(quiet(sdk.predict_long, LONG_TEXT, {"urgent": URGENT}, window=100),
                         quiet(run_async, pool, "predict_long", LONG_TEXT, {"urgent": URGENT}, window=100))
    _same_decision(quiet(sdk.decide, STATES[0], JSON_SCHEMA, return_details=True),
                   run_async(pool, "decide", STATES[0], JSON_SCHEMA, return_details=True))
    for w, h in zip(quiet(sdk.decide_batch, STATES, JSON_SCHEMA, min_confidence=0.5),
                    run_async(pool, "decide_batch", STATES, JSON_SCHEMA, min_confidence=0.5), strict=True):
        _same_decision(w, h)
    with pytest.raises(TypeError, match="expects a list of states"):
        run_async(pool, "predict_batch", "a state", QUESTIONS)


def _most_in_flight(pool) -> int:
    """The most requests of one AsyncClient.predict_batch in flight at once."""
    async def go():
        async with AsyncClient(pool.endpoint, timeout=60) as c:
            await c.describe()
            now, most, call = 0, 0, c.call

            async def spy(cmd, *args, **kwargs):
                nonlocal now, most
                if cmd != Cmd.REQUEST:        # the client's own questions (the table of direct routes) aside
                    return await call(cmd, *args, **kwargs)
                now += 1
                most = max(most, now)
                try:
                    return await call(cmd, *args, **kwargs)
                finally:
                    now -= 1
            c.call = spy
            for want, have in zip(await c.predict_batch(STATES, QUESTIONS), await c.predict_batch(STATES, QUESTIONS)):
                assert want == have
            return most
    return asyncio.run(go())


def test_async_batch_requests_are_in_flight_together_within_a_bound(pool, monkeypatch):
    import laya_pool.client.pool_async
    requests = math.ceil(len(STATES) / (MAX_ROWS // len(QUESTIONS)))
    assert _most_in_flight(pool) == requests == 4
    monkeypatch.setattr(laya_pool.client.pool_async, "BATCH_IN_FLIGHT", 2)
    assert _most_in_flight(pool) == 2
