"""The gateway's pure parts (gateway/jev.py, limits.py, naming.py) against the functions of `laya.serve` 0.4.15 they
answer for: the same values, the same refusals (status and detail), on generated inputs. No pool, no server.

tests/test_gateway.py then holds the whole HTTP surface against the SDK's own app.
"""
from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from laya_pool.gateway import calls, jev, limits, naming
from laya_pool.gateway.limits import Refusal
from laya_pool.protocol.qtypes import QUESTION_TYPES

serve = pytest.importorskip("laya.serve")
pytest.importorskip("fastapi")
from fastapi import HTTPException  # noqa: E402 - after the skip

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def outcome(fn, *args):
    """The value, or (status, detail) of the refusal: what the SDK's check and ours must agree on."""
    try:
        return ("ok", fn(*args))
    except HTTPException as e:
        return ("refused", e.status_code, e.detail)
    except Refusal as e:
        return ("refused", e.status, e.detail)


# ------------------------------------------------------------------------------------------------ jev

numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-3, 5), st.booleans(),
                    st.just("0.5"), st.just("x"), st.none())
probabilities = st.one_of(st.dictionaries(st.sampled_from(["0", "1", "2", "3", "10"]), numbers, max_size=5),
                          st.dictionaries(st.text(max_size=3), st.floats(0, 1), max_size=6), st.just([]), st.none())
answers = st.fixed_dictionaries({"type": st.sampled_from(["choice", "score", "noul", "other"]),
                                 "probabilities": probabilities},
                                optional={"choice": st.text(max_size=2), "score": st.floats(0, 3),
                                          "noul": st.floats(0, 1), "confidence": st.floats(0, 1),
                                          "legend": st.just({"0": "a"}), "action": st.just({"act_probability": 0.5}),
                                          "answer_confidence": st.floats(0, 1)})


@SETTINGS
@given(answers)
def test_jev_confidence_is_the_sdks(answer):
    from laya.confidence import jev_confidence
    ours, theirs = jev.jev_confidence(answer), jev_confidence(answer)
    assert (ours is None and theirs is None) or (ours == theirs or (math.isnan(ours) and math.isnan(theirs)))


@SETTINGS
@given(st.dictionaries(st.text(max_size=4), answers, max_size=4))
def test_jev_views_of_a_result_are_the_sdks(answer_map):
    result = {"model": "laya-rl-agent", "answers": answer_map, "usage": {"input_tokens": 3, "state_tokens": 1},
              "routing": {"model": "english"}}
    known = [a for a in answer_map.values() if QUESTION_TYPES.find(a["type"]) is not None]
    complete = [a for a in known if all(k in a for k in QUESTION_TYPES.find(a["type"]).served.strict_fields)]
    assert json.dumps(jev.add_jev_confidence(result)) == json.dumps(serve._add_jev_confidence(result))
    if len(complete) == len(known):
        assert json.dumps(jev.project_strict(result)) == json.dumps(serve._project_jev_strict(result))


def test_jev_confidence_on_known_values():
    # by the formulas' definitions, not by the SDK: a harness that compared two copies of one mistake would pass
    assert jev.jev_confidence({"type": "choice", "probabilities": {"a": 0.75, "b": 0.25}}) == pytest.approx(0.5)
    assert jev.jev_confidence({"type": "choice", "probabilities": {"a": 1.0}}) == 1.0
    assert jev.jev_confidence({"type": "score", "probabilities": {"0": 0.0, "1": 1.0, "2": 0.0}}) == 1.0
    assert jev.jev_confidence({"type": "score", "probabilities": {"0": 1, "1": 1, "2": 1}}) == pytest.approx(0.0)
    assert jev.jev_confidence({"type": "noul", "probabilities": {"0": 1.0}}) is None
    assert jev.jev_confidence({"type": "choice", "probabilities": {"a": True, "b": 0.0}}) is None


# ------------------------------------------------------------------------------------------------ limits

json_values = st.recursive(st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                                     st.text(alphabet=st.characters(codec="utf-8"), max_size=30)),
                           lambda inner: st.one_of(st.lists(inner, max_size=4),
                                                   st.dictionaries(st.text(max_size=5), inner, max_size=4)),
                           max_leaves=20)
big_text = st.integers(0, 3).map(lambda n: ["", "y" * 49_990, "z" * 50_001, '"' * 25_001][n])
states = st.one_of(st.none(), json_values, big_text, st.lists(big_text, max_size=3),
                   st.dictionaries(st.sampled_from("abc"), big_text, max_size=3))
levels = st.lists(st.one_of(st.text(max_size=3), st.none()), max_size=40)
options = st.one_of(st.dictionaries(st.text(max_size=4), st.text(max_size=3), max_size=110),
                    st.lists(st.text(max_size=3), max_size=110))
question = st.one_of(st.fixed_dictionaries({"type": st.just("choice"), "criteria": options}),
                     st.fixed_dictionaries({"type": st.just("score"), "criteria": levels}),
                     st.fixed_dictionaries({"type": st.sampled_from(["noul", "bogus"])}), st.integers(), st.none())
questions = st.one_of(st.dictionaries(st.text(max_size=6), question, max_size=8),
                      st.integers(62, 66).map(lambda n: {f"q{i}": {"type": "noul"} for i in range(n)}),
                      st.integers(4, 7).map(lambda n: {f"c{i}": {"type": "choice", "criteria": list(range(90))}
                                                       for i in range(n)}),
                      st.lists(st.none(), max_size=2), st.none())


@SETTINGS
@given(states, questions)
def test_request_checks_are_the_sdks(state, qs):
    assert outcome(limits.check_request, state, qs) == outcome(serve._check_request_limits, state, qs)


@SETTINGS
@given(st.one_of(st.lists(states, max_size=3), st.integers(63, 66).map(lambda n: ["x"] * n), st.just([]), states),
       questions)
def test_batch_checks_are_the_sdks(batch, qs):
    assert outcome(limits.check_batch, batch, qs) == outcome(serve._check_batch_limits, batch, qs)


@SETTINGS
@given(states)
def test_state_length_is_the_sdks(state):
    if state is not None:
        assert outcome(limits.state_length, state) == outcome(serve._state_length, state)


@SETTINGS
@given(json_values)
def test_lone_surrogates_are_found_as_the_sdk_finds_them(value):
    planted = {"a": [value, "ok \ud83d\ude00"], "b": "\udc00" if isinstance(value, bool) else "x"}
    assert limits.has_lone_surrogate(value) == serve._has_lone_surrogate(value)
    assert limits.has_lone_surrogate(planted) == serve._has_lone_surrogate(planted)


controls = st.dictionaries(
    st.sampled_from(["max_len", "head_max_len", "batch_size", "sort_by_length", "lang", "lang_guess", "hooks",
                     "on_predict_start", "hooks_timeout", "diagnostics", "other"]),
    st.one_of(st.none(), st.booleans(), st.integers(-2, 9000), st.floats(allow_nan=False), st.text(max_size=3),
              st.just([1])), max_size=5)


@SETTINGS
@given(controls)
def test_control_checks_are_the_sdks(body):
    for key in ("max_len", "head_max_len"):
        assert outcome(limits.budget, body, key) == outcome(serve._validate_budget_param, body, key, 8192)
    for key in ("lang", "lang_guess"):
        assert outcome(limits.language, body, key) == outcome(serve._validate_language_param, body, key)
    assert outcome(limits.batch_size, body) == outcome(serve._validate_batch_size_param, body)
    assert outcome(limits.sort_by_length, body) == outcome(serve._validate_sort_by_length_param, body)
    assert outcome(limits.refuse_controls, body) == outcome(serve._refuse_body_refusals, body)

    def both(b):
        serve._refuse_body_refusals(b)
        serve._refuse_out_parameters(b)
    assert outcome(limits.refuse_controls, body, True) == outcome(both, body)


def test_the_bounds_are_the_sdks():
    for name in ("MAX_QUESTIONS", "MAX_STATE_CHARS", "MAX_BATCH_STATES", "MAX_BODY_BYTES", "MAX_CHOICE_OPTIONS",
                 "MAX_SCORE_LEVELS", "MAX_TOTAL_OPTIONS", "BODY_REFUSALS"):
        assert getattr(limits, name) == getattr(serve, name), name
    assert limits.MAX_TOKEN_BUDGET == serve.DEFAULT_MAX_TOKEN_BUDGET
    assert limits.BATCH_OUT_PARAMETERS == serve.BATCH_BODY_OUT_PARAMETERS
    assert limits.LONE_SURROGATE == serve._LONE_SURROGATE_DETAIL


@pytest.mark.parametrize("raw", [b"{", b"", b"[1,", b"NaN", b'{"a": 1}', b"[" * 100_000, b'"\\ud800"'])
def test_json_parsing_is_the_sdks(raw):
    def theirs(r):
        import json as j
        try:
            return j.loads(r)
        except (ValueError, RecursionError):
            raise HTTPException(status_code=400, detail="request body must be valid JSON") from None
    ours = outcome(limits.parse_json, raw)
    want = outcome(theirs, raw)
    assert ours[0] == want[0] and (ours[0] == "refused" and ours == want or json.dumps(ours) == json.dumps(want))


# ------------------------------------------------------------------------------------------------ naming

def test_the_sdk_tables_are_copied_whole():
    from laya import router
    assert naming.ALIASES == router._ALIASES
    assert naming.BUNDLE_REPO == router.BUNDLE_REPO
    assert naming.SDK_CHECKPOINTS == tuple(router.DEFAULT_MODELS)
    assert naming.PUBLISHED == serve._published_model_ids()
    for text in ("", ".", "~x", "a/b", "a\\b", "english", "jev-1", "convaiinnovations/laya", " ml "):
        assert naming.names_a_source(text) == serve._names_unpublished_source(text), text
        assert naming.canonical(text) == router.canonical_name(text), text


@pytest.mark.parametrize("model, task, want", [
    (None, None, naming.AUTO_REASON), ("", None, naming.AUTO_REASON), ("jev-1", None, naming.AUTO_REASON),
    ("convaiinnovations/laya", None, naming.AUTO_REASON), (0, None, naming.AUTO_REASON),
    ("english", None, "explicit model='english'"), (" EN ", None, "explicit model='english'"),
    ("laya", "nope", "explicit model='english'"), (None, "english", "explicit task='english'"),
    (None, "Default", "explicit task='Default'"),
])
def test_routing_of_the_pools_checkpoint(model, task, want):
    assert naming.Checkpoint().route(model, task) == {"model": "english", "repo": None, "reason": want,
                                                      "detection": None, "workflow": None}


@pytest.mark.parametrize("model, task", [("multilingual", None), ("ML", None), ("./ckpt", None), ("org/repo", None),
                                         ("convaiinnovations/laya-multilingual", None), (None, "nope"),
                                         (None, "typed_decisions"), ("jev-1", "multilingual")])
def test_a_checkpoint_the_pool_does_not_serve_is_refused(model, task):
    with pytest.raises(Refusal) as e:
        naming.Checkpoint().route(model, task)
    assert e.value.status == 422 and e.value.detail.startswith("unknown model ")
    assert "choose one of ['english']" in e.value.detail


def test_another_name_serves_under_it():
    cp = naming.Checkpoint("typed-decisions")
    assert cp.route("decisions", None)["reason"] == "explicit model='typed-decisions'"
    assert cp.route(None, "typed_decisions")["model"] == "typed-decisions"
    with pytest.raises(Refusal):
        cp.route("english", None)


# ------------------------------------------------------------------------------------------------ calls

def test_a_body_becomes_the_pool_call():
    body = {"state": "s", "questions": {"q": {"type": "noul"}}, "max_len": 64, "lang": "de", "lang_guess": "fr",
            "min_confidence": 0.5, "model": "jev-1"}
    call = calls.single(body, naming.Checkpoint())
    assert call.states == ["s"] and call.questions == body["questions"]
    assert call.kwargs == {"max_len": 64, "lang": "de", "min_confidence": 0.5}
    b = calls.batch({"states": ["a", "b"], "questions": {}, "batch_size": 1, "sort_by_length": False, "task": "en"},
                    naming.Checkpoint())
    assert b.states == ["a", "b"] and b.kwargs == {"batch_size": 1} and b.routing["reason"] == "explicit task='en'"


def test_the_first_fault_is_the_one_reported():
    # laya serve's order: the limits, the refusals, the surrogates, the model, the budgets, the languages, the
    # threshold, (batch) the size and the sort, the task
    cp = naming.Checkpoint()
    body = {"state": "s", "questions": {"q": {"type": "noul"}}, "task": "nope", "min_confidence": 7, "lang": 1,
            "max_len": -1, "model": "./x", "hooks": 1}
    seen = []
    for key in ("hooks", "model", "max_len", "lang", "min_confidence", "task"):
        with pytest.raises(Refusal) as e:
            calls.single(body, cp)
        seen.append(e.value.detail.split()[0].strip(","))
        del body[key]
    assert seen == ["hooks", "unknown", "max_len", "lang", "min_confidence", "unknown"], seen
    with pytest.raises(Refusal, match="batch_size"):
        calls.batch({"states": ["s"], "questions": {}, "batch_size": 0, "task": "nope"}, cp)


def test_a_gateway_process_that_exits_is_started_again_after_a_doubling_delay():
    from laya_pool.gateway.processes import Restarts
    from laya_pool.protocol.lifecycle import BACKOFF_MAX as MAX_DELAY_S
    from laya_pool.protocol.lifecycle import BACKOFF_START as FIRST_DELAY_S
    from laya_pool.protocol.lifecycle import STABLE_AFTER as STEADY_S
    r = Restarts()
    r.started(100.0)
    waits = []
    for _ in range(8):                      # exits right after each start: 0.5, 1, 2, ... up to the cap
        now = r.due_at if r.due_at is not None else 100.0
        waits.append(r.exited(now + 0.1))
        assert not r.due(now + 0.1) and r.due(now + 0.1 + waits[-1])
        r.started(now + 0.1 + waits[-1])
    assert waits == [min(MAX_DELAY_S, FIRST_DELAY_S * 2 ** i) for i in range(8)]
    assert r.due_at is None and not r.due(1e9)               # running: nothing due
    assert r.exited(r.started_at + STEADY_S) == FIRST_DELAY_S   # up long enough: the delay starts over



def _counting_selector(spin_s: float):
    from laya_pool.gateway.spin import SpinSelector

    class Counting(SpinSelector):
        polls = waits = 0

        def _wait(self, timeout):
            if timeout == 0:
                self.polls += 1
            else:
                self.waits += 1
            return super()._wait(timeout)
    return Counting(spin_s)


def test_the_event_loop_polls_for_its_window_after_an_event_then_sleeps():
    import selectors
    import socket
    import time
    a, b = socket.socketpair()
    sel = _counting_selector(0.05)
    try:
        sel.register(a, selectors.EVENT_READ)
        assert sel.select(0.01) == [] and (sel.polls, sel.waits) == (0, 1)     # no event yet: it sleeps at once
        b.send(b"x")
        assert len(sel.select(1.0)) == 1 and (sel.polls, sel.waits) == (0, 2)  # woken
        a.recv(1)
        b.send(b"y")
        assert len(sel.select(1.0)) == 1 and sel.polls >= 1 and sel.waits == 2  # within the window: found by a poll
        a.recv(1)
        polls, t = sel.polls, time.monotonic()
        assert sel.select(1.0) == []             # nothing comes: polls out the 50 ms window, then sleeps the rest
        assert sel.polls - polls > 10 and sel.waits == 3 and 0.9 <= time.monotonic() - t < 1.5
        time.sleep(0.06)
        polls = sel.polls
        assert sel.select(0.01) == [] and sel.polls == polls and sel.waits == 4   # past the window: asleep at once
        assert sel.select(0) == []                                           # a zero timeout never blocks
    finally:
        sel.close()
        a.close()
        b.close()


def test_no_spin_is_asyncios_own_loop():
    import asyncio

    from laya_pool.gateway.spin import SpinSelector, loop_factory
    assert loop_factory(0) is asyncio.SelectorEventLoop
    loop = loop_factory(0.002)()
    try:
        assert isinstance(loop._selector, SpinSelector) and loop._selector.spin_s == 0.002
        assert loop.run_until_complete(asyncio.sleep(0.01, "slept")) == "slept"
    finally:
        loop.close()


def test_up_polls_the_gateways_event_loop_only_for_a_cuda_pool():
    from laya_pool.broker.supervisor import GATEWAY_SPIN_US, SupervisorConfig, gateway_argv

    def argv(devices: list[str]) -> list[str]:
        cfg = SupervisorConfig(model="m", devices=devices, frontend="tcp://127.0.0.1:5555", backend="ipc:///x")
        cfg.api, cfg.api_processes = "8000", 3
        return gateway_argv(cfg)
    cuda, cpu = argv(["cuda:0", "cuda:1"]), argv(["cpu"])
    assert cuda[cuda.index("--spin-us") + 1] == str(GATEWAY_SPIN_US) and "--spin-us" not in cpu
    assert cpu[cpu.index("--processes") + 1] == "3" and cpu[cpu.index("--listen") + 1] == "8000"
    from laya_pool.gateway.options import GatewayConfig
    assert GatewayConfig().spin_us == 0           # `laya-pool api` alone does not poll
