"""The HTTP gateway (`laya-pool api`) against `laya serve` 0.4.15 itself, the oracle.

The SDK's own FastAPI app (`laya.serve.create_app`, a Router whose checkpoints are all the tiny checkpoint) runs in
this process under uvicorn; the gateway runs as `python -m laya_pool api` in front of a real CPU pool (real processes,
real sockets). Every case goes to both, over HTTP, and must get the same status, the same headers that matter
(Retry-After, content type, X-Inference-Time-Ms and Server-Timing present), the same detail text for bad input, and
for good input the same JSON: every key in the same order, numbers within the suite's tolerance (`assert_answers_close`,
as the client's answers are held to the SDK's), `routing` apart. Where the two differ on purpose (the routing block,
names of checkpoints the pool does not serve), the test says so and checks what the gateway answers instead.

Then what only the gateway bounds (a head that never arrives, idle connections, too many connections), the pool
failing under it, many callers at once, and `laya-pool up --api` starting and stopping it.
"""
from __future__ import annotations

import contextlib
import copy
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import SUBPROCESS_ENV, assert_answers_close, free_port, stop_all, wait_until

from laya_pool.client.local import local_pool

httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
pytest.importorskip("laya.serve")

# The tiny checkpoint ships temperatures the SDK clamps, on purpose; its warning says so, in laya serve's thread.
pytestmark = [pytest.mark.timeout(300), pytest.mark.filterwarnings("ignore:laya. this checkpoint:RuntimeWarning")]
ROOT = Path(__file__).resolve().parents[1]
READ_TIMEOUT, IDLE_TIMEOUT, MAX_CONCURRENT, MAX_CONNECTIONS = 2, 1, 3, 24
MAX_ROWS = 16                       # the pool's rows (questions) a request: 20 questions are more than it takes
KEY = "s3cret-key"
NAMES = "['english', 'multilingual', 'typed-decisions']"     # laya serve's "unknown model" lists these; ours one

TEAM = {"type": "choice", "instructions": "Which team handles this ticket?",
        "criteria": {"it": "hardware and software problems", "hr": "people matters", "sales": "deals"}}
URGENT = {"type": "noul", "instructions": "Is this urgent?"}
SEVERITY = {"type": "score", "instructions": "How severe is it?", "criteria": ["minor", "major", "critical"]}
QUESTIONS = {"team": TEAM, "urgent": URGENT, "severity": SEVERITY}
STATES = ["the printer on floor 3 is broken and nobody can print the quarterly report",
          {"ticket": 4411, "text": "please refund order 99, it arrived broken", "customer": "vip"},
          [{"role": "user", "content": "hi"}, {"role": "user", "content": "cancel my plan today"}],
          "word " * 700, "naïve café — ünïcode 🙂", "x"]


# ------------------------------------------------------------------------------------------------ the two servers

class Thread(threading.Thread):
    """A uvicorn server for `app` in a thread of this process."""

    def __init__(self, app, port: int):
        super().__init__(daemon=True)
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))

    def run(self):
        self.server.run()

    def stop(self):
        self.server.should_exit = True
        self.join(10)


def _router(ckpt: Path):
    from laya.router import Router
    # Every checkpoint is the tiny one; `lang_guess` sends what names none to `english`, as the pool's one name.
    return Router(models={n: str(ckpt) for n in ("english", "multilingual", "typed-decisions")}, device="cpu",
                  lang_guess="en")


def _oracle(router, env: dict[str, str]):
    """laya serve's app, built under `env` (it reads its variables when it is created), served in a thread."""
    from laya.serve import create_app
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        app = create_app(router=router)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    port = free_port()
    t = Thread(app, port)
    t.start()
    base = f"http://127.0.0.1:{port}"
    wait_until(lambda: httpx.get(base + "/health").status_code == 200, 60, "laya serve did not start",
               ignore=(httpx.HTTPError,))
    return t, base


@pytest.fixture(scope="module")
def router(tiny_ckpt):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = _router(tiny_ckpt)
        r.preload(["english"])
    return r


@pytest.fixture(scope="module")
def oracle(router):
    t, base = _oracle(router, {"LAYA_BODY_READ_TIMEOUT": str(READ_TIMEOUT), "LAYA_MAX_CONCURRENT": str(MAX_CONCURRENT)})
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c
    t.stop()


@pytest.fixture(scope="module")
def pool(tiny_ckpt):
    args = ["--threads", "1", "--max-batch", "8", "--max-rows", str(MAX_ROWS)]
    with local_pool(tiny_ckpt, "cpu", extra_args=args) as p:
        yield p


def start_gateway(frontend: str, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "laya_pool", "api", "--frontend", frontend, "--listen",
                             f"127.0.0.1:{port}", *flags], cwd=ROOT, env={**SUBPROCESS_ENV, **(env or {})},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base = f"http://127.0.0.1:{port}"

    def up():
        assert proc.poll() is None, proc.stderr.read()
        return httpx.get(base + "/health").status_code == 200
    wait_until(up, 60, "the gateway did not start", ignore=(httpx.HTTPError,))
    return proc, base


@pytest.fixture(scope="module")
def gateway(pool):
    proc, base = start_gateway(pool.endpoint, "--read-timeout", str(READ_TIMEOUT), "--idle-timeout",
                               str(IDLE_TIMEOUT), "--max-concurrent", str(MAX_CONCURRENT), "--max-connections",
                               str(MAX_CONNECTIONS))
    with httpx.Client(base_url=base, timeout=60) as c:
        yield c
    stop_all([proc])


# ------------------------------------------------------------------------------------------------ the comparison

def strip_routing(body):
    if isinstance(body, dict) and "results" in body:
        return {**body, "results": [strip_routing(r) for r in body["results"]]}
    return {k: v for k, v in body.items() if k != "routing"} if isinstance(body, dict) else body


def routings(body) -> list[dict]:
    return [r.get("routing") for r in body["results"]] if "results" in body else [body.get("routing")]


def expect_same(want: httpx.Response, have: httpx.Response, explicit: bool = False) -> None:
    """`have` (the gateway's) answers as `want` (laya serve's) does; `explicit`: the request named the checkpoint, so
    both routing blocks say so in the same words."""
    assert have.status_code == want.status_code, (want.text[:300], have.text[:300])
    for header in ("retry-after", "content-type"):
        assert have.headers.get(header) == want.headers.get(header), header
    if want.status_code != 200:
        assert have.json() == {"detail": want.json()["detail"].replace(NAMES, "['english']")}
        return
    for r in (want, have):
        assert "x-inference-time-ms" in r.headers
        float(r.headers["x-inference-time-ms"])
        assert r.headers["server-timing"] == f"inference;dur={r.headers['x-inference-time-ms']}"
    w, h = want.json(), have.json()
    assert_answers_close(strip_routing(w), strip_routing(h))
    for theirs, ours in zip(routings(w), routings(h)):
        if theirs is None:                      # the strict projection has none
            assert ours is None
            continue
        assert list(ours) == list(theirs) and ours["model"] == "english" and ours["repo"] is None
        assert ours["detection"] is None and ours["workflow"] is None and theirs["workflow"] is None
        assert ours["reason"] == (theirs["reason"] if explicit else "the pool serves one checkpoint")


def both(oracle, gateway, method: str, path: str, **kw) -> tuple[httpx.Response, httpx.Response]:
    return oracle.request(method, path, **kw), gateway.request(method, path, **kw)


# ------------------------------------------------------------------------------------------------ good input

GOOD = [
    {"state": STATES[0], "questions": QUESTIONS},
    {"state": STATES[1], "questions": QUESTIONS},
    {"state": STATES[2], "questions": {"urgent": URGENT}},
    {"state": STATES[3], "questions": QUESTIONS},                                    # truncated: usage says so
    {"state": STATES[4], "questions": {"team": TEAM, "sev": {**SEVERITY, "criteria": [f"l{i}" for i in range(9)]}}},
    {"state": STATES[5], "questions": {"pick": {"type": "choice", "instructions": "pick one",
                                                "criteria": ["alpha", "beta", "gamma", "delta"]}}},
    {"state": STATES[0], "questions": QUESTIONS, "min_confidence": 0.5},
    {"state": STATES[0], "questions": QUESTIONS, "min_confidence": {"choice:3-5": 0.9, "default": 0.2}},
    {"state": STATES[3], "questions": QUESTIONS, "max_len": 96, "head_max_len": 48},
    {"state": STATES[0], "questions": QUESTIONS, "model": "jev-1"},
    {"state": STATES[0], "questions": QUESTIONS, "model": "convaiinnovations/laya"},
    {"state": STATES[0], "questions": QUESTIONS, "lang_guess": None, "lang": None, "hooks": None},
    {"state": STATES[0], "questions": {}},
    {"state": "", "questions": {"urgent": URGENT}},
    {"state": "x", "questions": {"a": {"type": "noul", "instructions": 5}}},          # the SDK takes it: so do we
]
EXPLICIT = [
    {"state": STATES[0], "questions": QUESTIONS, "model": "english"},
    {"state": STATES[0], "questions": QUESTIONS, "model": " EN "},
    {"state": STATES[1], "questions": QUESTIONS, "task": "english"},
    {"state": STATES[1], "questions": QUESTIONS, "model": "laya", "task": "nope"},     # model wins: task not read
]


@pytest.mark.parametrize("body", GOOD + EXPLICIT, ids=range(len(GOOD + EXPLICIT)))
def test_a_decision_is_laya_serves(oracle, gateway, body):
    want, have = both(oracle, gateway, "POST", "/v1/systemone", json=body)
    assert want.status_code == 200, want.text
    expect_same(want, have, explicit=body in EXPLICIT)
    answers = have.json()["answers"]
    assert all("x_jev_confidence" in a for a in answers.values() if a["type"] != "noul")


@pytest.mark.parametrize("body", [
    {"states": STATES, "questions": QUESTIONS},
    {"states": STATES[:3], "questions": QUESTIONS, "batch_size": 2, "sort_by_length": True, "min_confidence": 0.4},
    {"states": ["one", "two"], "questions": {"urgent": URGENT}, "sort_by_length": False, "max_len": 64},
    {"states": ["a"], "questions": {}},
])
def test_a_batch_is_laya_serves(oracle, gateway, body):
    want, have = both(oracle, gateway, "POST", "/v1/systemone/batch", json=body)
    assert want.status_code == 200, want.text
    expect_same(want, have)
    assert have.json()["total_usage"]["input_tokens"] == sum(r["usage"]["input_tokens"]
                                                             for r in have.json()["results"])


def test_the_strict_jev_projection_is_laya_serves(oracle, pool, monkeypatch):
    proc, base = start_gateway(pool.endpoint, "--jev-strict")
    try:
        monkeypatch.setenv("LAYA_JEV_STRICT", "1")       # laya serve reads it on every request
        with httpx.Client(base_url=base, timeout=60) as strict:
            for path, body in (("/v1/systemone", GOOD[0]), ("/v1/systemone/batch", {"states": STATES[:2],
                                                                                     "questions": QUESTIONS})):
                want, have = both(oracle, strict, "POST", path, json=body)
                expect_same(want, have)
                assert json.dumps(want.json()).count("routing") == 0 == json.dumps(have.json()).count("action")
    finally:
        stop_all([proc])


# ------------------------------------------------------------------------------------------------ bad input

BIG = "y" * 50_001
BAD = [
    b"{", b"[]", b"", b'"text"', b'{"state": "x"}', b'{"questions": {}}', b'{"state": null, "questions": {}}',
    b'{"state": "x", "questions": []}', b'{"state": "x", "questions": {"a": {"type": "noul"}}, "state2": "\\ud800"}',
    json.dumps({"state": "x", "questions": {f"q{i}": URGENT for i in range(65)}}).encode(),
    json.dumps({"state": "x", "questions": {"c": {"type": "choice", "criteria": list(range(101))}}}).encode(),
    json.dumps({"state": "x", "questions": {"s": {"type": "score", "criteria": list(range(33))}}}).encode(),
    json.dumps({"state": "x", "questions": {"s": {"type": "score", "criteria": ["a", None]}}}).encode(),
    json.dumps({"state": "x", "questions": {f"c{i}": {"type": "choice", "criteria": list(range(90))}
                                            for i in range(6)}}).encode(),
    json.dumps({"state": BIG, "questions": {}}).encode(),
    json.dumps({"state": {"a": BIG, "b": "z"}, "questions": {}}).encode(),
    json.dumps({"state": {"a": '"' * 25_001}, "questions": {}}).encode(),
    json.dumps({"state": "x", "questions": {}, "hooks": ["h"], "on_predict_end": 1}).encode(),
    json.dumps({"state": "x", "questions": {}, "model": "./ckpt"}).encode(),
    json.dumps({"state": "x", "questions": {}, "model": "org/unpublished"}).encode(),
    json.dumps({"state": "x", "questions": {}, "max_len": "64"}).encode(),
    json.dumps({"state": "x", "questions": {}, "max_len": 0}).encode(),
    json.dumps({"state": "x", "questions": {}, "head_max_len": 9000}).encode(),
    json.dumps({"state": "x", "questions": {}, "lang": 5}).encode(),
    json.dumps({"state": "x", "questions": {}, "lang_guess": True}).encode(),
    json.dumps({"state": "x", "questions": {}, "min_confidence": 2}).encode(),
    json.dumps({"state": "x", "questions": {}, "min_confidence": {"choice:2": "high"}}).encode(),
    json.dumps({"state": "x", "questions": {}, "task": "nope"}).encode(),
    json.dumps({"state": "x", "questions": {"a": {"type": "bogus"}}}).encode(),
    json.dumps({"state": "x", "questions": {"a": {"type": "choice", "instructions": "?"}}}).encode(),
    json.dumps({"state": "x", "questions": {"a": {"type": "choice", "criteria": {"only": "one"}}}}).encode(),
    json.dumps({"state": "x", "questions": {"a": {"type": "score", "criteria": "abc"}}}).encode(),
    json.dumps({"state": "x", "questions": {"a": "noul"}}).encode(),
    json.dumps({"state": "x", "questions": {"a": URGENT, "b": {"type": "noul"}}, "min_confidence": -1}).encode(),
]


@pytest.mark.parametrize("raw", BAD, ids=range(len(BAD)))
def test_bad_input_is_refused_as_laya_serve_refuses_it(oracle, gateway, raw):
    want, have = both(oracle, gateway, "POST", "/v1/systemone", content=raw)
    assert want.status_code in (400, 413, 422), want.text
    expect_same(want, have)


BAD_BATCH = [
    {"questions": {}}, {"states": [], "questions": {}}, {"states": "x", "questions": {}},
    {"states": ["x"] * 65, "questions": {}}, {"states": ["x", None], "questions": {}},
    {"states": ["x"], "questions": {}, "diagnostics": {}}, {"states": ["x"], "questions": {}, "batch_size": 0},
    {"states": ["x"], "questions": {}, "batch_size": 1.5}, {"states": ["x"], "questions": {}, "sort_by_length": "y"},
    {"states": ["x"], "questions": {}, "batch_size": 0, "task": "nope"},
    {"states": ["x", "y"], "questions": {"a": {"type": "bogus"}}},
]


@pytest.mark.parametrize("body", BAD_BATCH, ids=range(len(BAD_BATCH)))
def test_a_bad_batch_is_refused_as_laya_serve_refuses_it(oracle, gateway, body):
    want, have = both(oracle, gateway, "POST", "/v1/systemone/batch", json=body)
    assert want.status_code in (400, 413, 422), want.text
    expect_same(want, have)


def test_oversized_bodies_are_413_however_framed(oracle, gateway):
    big = b'{"state": "' + b"x" * (2 * 1024 * 1024) + b'", "questions": {}}'

    def chunks():                   # no Content-Length: chunked
        for i in range(0, len(big), 65536):
            yield big[i:i + 65536]
    for path in ("/v1/systemone", "/v1/systemone/batch"):
        for framed in (lambda: big, chunks):
            want, have = oracle.post(path, content=framed()), gateway.post(path, content=framed())
            assert want.status_code == 413
            expect_same(want, have)


def test_routes_methods_and_schema_are_laya_serves(oracle, gateway):
    for method, path in (("GET", "/v1/systemone"), ("PUT", "/v1/systemone/batch"), ("GET", "/nowhere"),
                         ("POST", "/health")):
        expect_same(*both(oracle, gateway, method, path))
    want, have = both(oracle, gateway, "GET", "/openapi.json")
    assert have.status_code == 200 and have.json()["paths"] == want.json()["paths"]
    assert set(have.json()["paths"]) == {"/health", "/v1/systemone", "/v1/systemone/batch"}
    for page in ("/docs", "/redoc"):
        assert [r.status_code for r in both(oracle, gateway, "GET", page)] == [200, 200]


def test_health_has_laya_serves_keys_and_the_pools_state(oracle, gateway):
    want, have = both(oracle, gateway, "GET", "/health")
    w, h = want.json(), have.json()
    assert list(h)[:len(w)] == list(w) and h["status"] == "ok" and h["loaded"] == ["english"]
    assert h["device"] == "cpu" and h["device_is_preference"] is False and h["checkpoint_devices"] == {"english": "cpu"}
    assert h["x_pool"]["reachable"] is True and h["x_pool"]["ready"] == 1 and len(h["revisions"]["english"]) == 64


def test_a_checkpoint_the_pool_does_not_serve_is_422_not_another_answer(oracle, gateway):
    # laya serve answers from its multilingual checkpoint; the pool has one checkpoint, and it is not that one
    for body in ({"state": "x", "questions": {}, "model": "multilingual"},
                 {"state": "x", "questions": {}, "model": "convaiinnovations/laya-multilingual"},
                 {"state": "x", "questions": {}, "task": "typed-decisions"}):
        want, have = both(oracle, gateway, "POST", "/v1/systemone", json=body)
        assert want.status_code == 200 and have.status_code == 422
        assert have.json()["detail"].startswith("unknown model ") and "choose one of ['english']" in have.json()[
            "detail"]


def test_more_questions_than_the_pool_takes_is_413_naming_its_limit(oracle, gateway):
    # laya serve runs any number of questions up to 64 in one forward; a pool's workers have a capacity a request
    body = {"state": "x", "questions": {f"q{i}": URGENT for i in range(MAX_ROWS + 4)}}
    want, have = both(oracle, gateway, "POST", "/v1/systemone", json=body)
    assert want.status_code == 200 and have.status_code == 413
    assert "exceed the pool's limit of 16 per request (max_rows)" in have.json()["detail"]


@pytest.mark.parametrize("state", [5, True, [], {}, 0.5, [1, "a"]])
def test_states_of_any_json_type_are_laya_serves(oracle, gateway, state):
    expect_same(*both(oracle, gateway, "POST", "/v1/systemone", json={"state": state, "questions": QUESTIONS}))


# ------------------------------------------------------------------------------------------------ the harness

def test_the_harness_catches_a_planted_difference(oracle, gateway):
    good, ours = both(oracle, gateway, "POST", "/v1/systemone", json=GOOD[0])
    bad, ours_bad = both(oracle, gateway, "POST", "/v1/systemone", content=b"{")
    busy = httpx.Response(503, json={"detail": "server busy, try again later"}, headers={"Retry-After": "1"})

    def planted(resp, status=None, body=None, headers=None, drop=()):
        h = {k: v for k, v in resp.headers.items() if k.lower() not in drop and k.lower() != "content-length"}
        return httpx.Response(status or resp.status_code, json=body if body is not None else resp.json(),
                              headers={**h, **(headers or {})})

    def edit(fn):
        body = copy.deepcopy(ours.json())
        fn(body)
        return planted(ours, body=body)

    for want, have in ((good, ours), (bad, ours_bad), (busy, busy)):
        expect_same(want, planted(have))                                      # an unchanged copy passes
    plants = [
        (good, planted(ours, status=201)), (bad, planted(ours_bad, status=422)),
        (bad, planted(ours_bad, body={"detail": "bad JSON"})), (busy, planted(busy, drop=("retry-after",))),
        (good, planted(ours, drop=("x-inference-time-ms",))),
        (good, edit(lambda b: b["answers"]["team"]["probabilities"].__setitem__(
            "it", b["answers"]["team"]["probabilities"]["it"] + 3e-4))),
        (good, edit(lambda b: b["answers"]["team"].pop("x_jev_confidence"))),
        (good, edit(lambda b: b["usage"].__setitem__("truncated", 0))),
        (good, edit(lambda b: b["routing"].__setitem__("model", "multilingual"))),
        (good, edit(lambda b: b.__setitem__("answers", dict(reversed(list(b["answers"].items())))))),
    ]
    for want, plant in plants:
        with pytest.raises(AssertionError):
            expect_same(want, plant)


def _in_process(app, **kw):
    from starlette.testclient import TestClient
    return TestClient(app, raise_server_exceptions=False, **kw)


def _same_bytes(a: httpx.Response, b: httpx.Response) -> None:
    """Status, header names and values in order (the inference time's value apart), and body bytes."""
    def heads(r):
        return [(k, "t" if k in ("x-inference-time-ms", "server-timing") else v) for k, v in r.headers.multi_items()]
    assert (a.status_code, heads(a), a.content) == (b.status_code, heads(b), b.content)


def test_the_decision_routes_in_front_answer_as_fastapis_routes_do(pool):
    """gateway/routes.py answers the decision routes before FastAPI is entered; FastAPI's own routes (served alone)
    answer through the same function. On good input, each kind of refusal and a fault: the same bytes."""
    from laya_pool.gateway.app import create_app
    from laya_pool.gateway.options import GatewayConfig
    from laya_pool.gateway.routes import in_front

    cfg = GatewayConfig(frontend=pool.endpoint, api_key=KEY, max_concurrent=4)
    auth = {"Authorization": f"Bearer {KEY}"}
    asks = [("/v1/systemone", {"json": GOOD[0], "headers": auth}),
            ("/v1/systemone/batch", {"json": {"states": STATES[:2], "questions": QUESTIONS}, "headers": auth}),
            ("/v1/systemone", {"json": GOOD[0]}),                                             # 401
            ("/v1/systemone", {"content": b"{", "headers": auth}),                            # 400
            ("/v1/systemone", {"json": {"state": "x", "questions": {"a": 5}}, "headers": auth}),     # 422
            ("/v1/systemone", {"content": b"{}", "headers": {**auth, "Content-Length": str(3 << 20)}}),  # 413
            ("/v1/systemone", {"json": {**GOOD[0], "questions": {f"q{i}": URGENT for i in range(MAX_ROWS + 4)}},
                               "headers": auth})]                                             # 413: the pool's limit
    with _in_process(create_app(cfg)) as alone, _in_process(in_front(create_app(cfg))) as fronted:
        answers = [(alone.post(path, **kw), fronted.post(path, **kw)) for path, kw in asks]
    assert [a.status_code for a, _ in answers] == [200, 200, 401, 400, 422, 413, 413]
    for a, b in answers:
        _same_bytes(a, b)

    class NotJson:      # a fault no pool causes (an answer JSON cannot carry), put where the pool's answer goes
        async def predict(self, *a, **kw):
            return {"answers": {}, "usage": {}, "x": float("nan")}

        def close(self):
            pass
    faulty = [create_app(cfg, NotJson) for _ in range(2)]
    with _in_process(faulty[0]) as alone, _in_process(in_front(faulty[1])) as fronted:
        a, b = (c.post("/v1/systemone", json=GOOD[0], headers=auth) for c in (alone, fronted))
    assert a.status_code == 500 and a.text == "Internal Server Error"
    _same_bytes(a, b)
    good = answers[0][0]
    for planted in (httpx.Response(200, headers=[*good.headers.multi_items(), ("x-more", "1")], content=good.content),
                    httpx.Response(200, headers=good.headers.multi_items(), content=good.content.replace(b":", b": "))):
        with pytest.raises(AssertionError):
            _same_bytes(good, planted)


# ------------------------------------------------------------------------------------------------ auth

def test_bearer_auth_is_laya_serves(router, pool, tmp_path):
    t, base = _oracle(router, {"LAYA_API_KEY": KEY})
    (tmp_path / "key").write_text(KEY + "\n")
    proc, ours = start_gateway(pool.endpoint, "--api-key-file", str(tmp_path / "key"))
    try:
        with httpx.Client(base_url=base, timeout=60) as o, httpx.Client(base_url=ours, timeout=60) as g:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY},
                            {"Authorization": b"Bearer s\xe9cret"}, {"Authorization": f"Bearer {KEY}"}):
                want, have = both(o, g, "POST", "/v1/systemone", json=GOOD[0], headers=headers)
                expect_same(want, have)
                want, have = both(o, g, "POST", "/v1/systemone/batch", json={"states": ["x"], "questions": {}},
                                  headers=headers)
                expect_same(want, have)
                want, have = both(o, g, "GET", "/health", headers=headers)
                assert (want.json() == {"status": "ok"}) == (have.json() == {"status": "ok"})
            assert o.post("/v1/systemone").status_code == 401
            for page in ("/openapi.json", "/docs", "/redoc"):           # the schema is not public behind a key
                expect_same(*both(o, g, "GET", page))
                assert g.get(page).status_code == 404
    finally:
        stop_all([proc])
        t.stop()


# ------------------------------------------------------------------------------------------------ time and bounds

def _open(base: str) -> socket.socket:
    host, port = base.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=30)


def _stalled(base: str) -> socket.socket:
    """A request whose head arrived and whose body never will: it holds an admission slot."""
    s = _open(base)
    s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"state\"")
    return s


def _answer(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(
        b"content-length")), 0)
    while len(body) < length:
        body += s.recv(65536)
    return int(head.split()[1]), body


def test_a_stalled_body_is_408_as_in_laya_serve(oracle, gateway):
    for client in (oracle, gateway):
        s = _stalled(str(client.base_url))
        t = time.monotonic()
        status, body = _answer(s)
        s.close()
        assert status == 408 and json.loads(body) == {"detail": "request body was not received in time"}
        assert READ_TIMEOUT - 0.5 < time.monotonic() - t < READ_TIMEOUT + 3


def test_past_max_concurrent_is_503_as_in_laya_serve(oracle, gateway):
    for client in (oracle, gateway):
        held = [_stalled(str(client.base_url)) for _ in range(MAX_CONCURRENT)]
        time.sleep(0.3)
        refused = client.post("/v1/systemone", json=GOOD[0])
        for s in held:
            s.close()
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json() == {"detail": "server busy, try again later"}
    time.sleep(READ_TIMEOUT + 0.5)            # the held slots are released (408) before the next test
    expect_same(*both(oracle, gateway, "POST", "/v1/systemone", json=GOOD[0]))


def _closed_within(s: socket.socket, seconds: float, trickle: bytes = b"") -> float:
    """Seconds until the server closes `s` (sending `trickle` a byte every 0.3 s meanwhile); fails past `seconds`."""
    t = time.monotonic()
    s.settimeout(0.3)
    for i in range(int(seconds / 0.3) + 1):
        if trickle:
            try:
                s.sendall(trickle[i % len(trickle):i % len(trickle) + 1])
            except OSError:
                return time.monotonic() - t
        try:
            if s.recv(65536) == b"":
                return time.monotonic() - t
        except TimeoutError:
            continue
        except OSError:
            return time.monotonic() - t
    pytest.fail(f"the connection stayed open {seconds} s")


def test_heads_that_never_arrive_and_idle_connections_are_closed(gateway):
    base = str(gateway.base_url)
    assert _closed_within(_open(base), READ_TIMEOUT + 2) >= READ_TIMEOUT - 0.5          # silent from the start
    slow = _open(base)
    slow.sendall(b"POST /v1/systemone HTTP/1.1\r\n")
    assert _closed_within(slow, READ_TIMEOUT + 2, trickle=b"X-Slow: yes\r\n") >= READ_TIMEOUT - 0.5
    kept = _open(base)
    kept.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert _answer(kept)[0] == 200
    assert _closed_within(kept, IDLE_TIMEOUT + 2) < READ_TIMEOUT       # idle after its answer: the keep-alive bound
    assert gateway.get("/health").status_code == 200


def _until_closed(s: socket.socket) -> bytes:
    """Everything `s` receives until the server closes it (a reset counts as closed); fails after 5 s open."""
    s.settimeout(5)
    data = b""
    try:
        while chunk := s.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    return data


@pytest.fixture(scope="module", params=["httptools", "h11"])
def parsed_by(request, pool):
    """A gateway of the module's pool whose connections are parsed by httptools, then by h11: its base URL."""
    if request.param == "httptools":
        pytest.importorskip("httptools")
    proc, base = start_gateway(pool.endpoint, "--http-parser", request.param)
    yield base
    stop_all([proc])


def test_a_head_over_16_kib_is_400_however_it_arrives(parsed_by):
    from laya_pool.gateway import connection
    filler = b"X-Filler: " + b"a" * 8000 + b"\r\n"
    for pieces in (1, 7):                        # one write, or a head trickling in over several reads
        s = _open(parsed_by)
        head = b"GET /health HTTP/1.1\r\nHost: x\r\n" + filler * 3 + b"\r\n"
        assert len(head) > connection.MAX_HEAD_BYTES
        step = -(-len(head) // pieces)
        with contextlib.suppress(ConnectionError):     # closed while the rest is sent
            for i in range(0, len(head), step):
                s.sendall(head[i:i + step])
                time.sleep(0.02)
        got = _until_closed(s)          # the 400, unless the close over unread bytes reset the connection first
        assert got.startswith(b"HTTP/1.1 400 ") or got == b"", got[:200]
        s.close()
    s = _open(parsed_by)                          # under the bound, and a body sent with its head: answered
    s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n" + filler + b"\r\n")
    assert _answer(s)[0] == 200
    body = json.dumps({"state": "y" * 40_000, "questions": QUESTIONS}).encode()
    s.sendall(b"POST /v1/systemone HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d"
              b"\r\n\r\n" % len(body) + body)
    assert _answer(s)[0] == 200
    s.close()


def test_past_max_connections_a_request_is_503(gateway):
    base = str(gateway.base_url)
    held = [_open(base) for _ in range(MAX_CONNECTIONS)]
    try:
        s = _open(base)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _answer(s)[0] == 503
    finally:
        for s in held:
            s.close()
    wait_until(lambda: gateway.get("/health").status_code == 200, 10, "the gateway did not recover")


# ------------------------------------------------------------------------------------------------ the pool under it

def test_concurrent_callers_get_their_own_answers_from_merged_forwards(pool):
    proc, base = start_gateway(pool.endpoint)
    bodies = [{"state": f"ticket {i}: " + STATES[(0, 4, 5)[i % 3]], "questions": QUESTIONS} for i in range(24)]

    def merged() -> int:
        return sum((w.get("stats") or {}).get("merged_requests", 0) for w in pool.status()["workers"])
    try:
        with httpx.Client(base_url=base, timeout=60) as c:
            alone = [c.post("/v1/systemone", json=b).json() for b in bodies]
        before = merged()
        with ThreadPoolExecutor(12) as ex, httpx.Client(base_url=base, timeout=60,
                                                        limits=httpx.Limits(max_connections=12)) as c:
            together = list(ex.map(lambda b: c.post("/v1/systemone", json=b), bodies * 2))
        assert [r.status_code for r in together] == [200] * 48
        for resp, want in zip(together, alone * 2):
            assert_answers_close(want, resp.json())
        # one AsyncClient for every HTTP caller: requests in flight together, which the worker merges
        wait_until(lambda: merged() > before, 10, "the worker merged none of the concurrent requests")
    finally:
        stop_all([proc])


def test_a_pool_that_does_not_answer_is_503(tmp_path):
    proc, base = start_gateway(f"ipc://{tmp_path}/nobody", "--call-timeout", "1")
    try:
        r = httpx.post(base + "/v1/systemone", json=GOOD[0], timeout=30)
        assert r.status_code == 503 and r.headers["retry-after"] == "1" and r.json()["detail"].endswith(
            "try again later")
        assert httpx.get(base + "/health").json()["x_pool"] == {"reachable": False, "workers": 0, "ready": 0,
                                                                "devices": [], "frontend": f"ipc://{tmp_path}/nobody"}
    finally:
        stop_all([proc])


def _gateway_processes(pid: int) -> list:
    """The gateway processes `laya-pool api` (pid) runs: its spawned children, less one exited and not yet reaped."""
    import psutil

    def spawned(c: psutil.Process) -> bool:
        try:
            return c.status() != psutil.STATUS_ZOMBIE and any("spawn_main" in part for part in c.cmdline())
        except psutil.Error:
            return False
    return [c for c in psutil.Process(pid).children() if spawned(c)]


def test_processes_share_the_port_and_one_that_dies_is_started_again(pool):
    proc, base = start_gateway(pool.endpoint, "--processes", "2")
    try:
        wait_until(lambda: len(_gateway_processes(proc.pid)) == 2, 30, "the gateway did not start 2 processes")
        first = {c.pid for c in _gateway_processes(proc.pid)}
        with ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda b: httpx.post(base + "/v1/systemone", json=b, timeout=60), GOOD[:2] * 8))
        assert [r.status_code for r in got] == [200] * 16, [r.text for r in got if r.status_code != 200]
        victim = min(first)
        os.kill(victim, signal.SIGKILL)
        # the other process answers meanwhile; the dead one is started again after its backoff (0.5 s)
        assert httpx.post(base + "/v1/systemone", json=GOOD[0], timeout=60).status_code == 200
        wait_until(lambda: len(_gateway_processes(proc.pid)) == 2, 30, "the killed gateway process was not replaced")
        assert victim not in {c.pid for c in _gateway_processes(proc.pid)}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "exited (code -9); starting it again in 0.5 s" in proc.stderr.read()
    finally:
        stop_all([proc])


def test_the_gateways_processes_die_with_it(pool):
    proc, base = start_gateway(pool.endpoint, "--processes", "2")
    try:
        wait_until(lambda: len(_gateway_processes(proc.pid)) == 2, 30, "the gateway did not start 2 processes")
        kids = _gateway_processes(proc.pid)
        proc.kill()                        # no drain, no handler: the kernel tells the children
        proc.wait(10)
        wait_until(lambda: not any(k.is_running() and k.status() != "zombie" for k in kids), 15,
                   "a gateway process outlived its parent", ignore=(Exception,))
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health", timeout=5)
    finally:
        stop_all([proc])


# ------------------------------------------------------------------------------------------------ up --api

def test_up_starts_the_gateway_beside_the_pool_and_stops_it(tiny_ckpt, tmp_path):
    port, frontend = free_port(), f"ipc://{tmp_path}/frontend"
    up = subprocess.Popen([sys.executable, "-m", "laya_pool", "up", "--model", str(tiny_ckpt), "--devices", "cpu",
                           "--threads", "1", "--frontend", frontend, "--backend", f"ipc://{tmp_path}/backend",
                           "--api", str(port), "--api-processes", "2"], cwd=ROOT, env=SUBPROCESS_ENV,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: httpx.get(base + "/health").json()["x_pool"]["ready"] == 1, 120,
                   "the gateway of `up --api` did not see a ready worker", ignore=(httpx.HTTPError,))
        r = httpx.post(base + "/v1/systemone", json=GOOD[0], timeout=60)
        assert r.status_code == 200 and set(r.json()["answers"]) == set(QUESTIONS)
        import psutil
        api = [c for c in psutil.Process(up.pid).children() if " api " in " ".join(c.cmdline())]
        assert len(api) == 1 and len(_gateway_processes(api[0].pid)) == 2        # --api-processes 2
        up.send_signal(signal.SIGTERM)
        assert up.wait(30) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(base + "/health")
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(10)


def test_up_with_its_api_port_taken_stops_with_78(tiny_ckpt, tmp_path):
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        up = subprocess.run([sys.executable, "-m", "laya_pool", "up", "--model", str(tiny_ckpt), "--devices", "cpu",
                             "--threads", "1", "--frontend", f"ipc://{tmp_path}/fe", "--backend",
                             f"ipc://{tmp_path}/be", "--api", str(held.getsockname()[1])], cwd=ROOT,
                            env=SUBPROCESS_ENV, capture_output=True, text=True, timeout=120)
    assert up.returncode == 78, up.stderr[-3000:]
    assert "cannot listen on 127.0.0.1:" in up.stderr and "gateway cannot start (exit 78" in up.stderr
