"""Every client-side error names the question or field, and is raised before anything is sent when it can be
known locally: bytes and lone surrogates in the state or a question, and more questions (rows, tokens,
markers) than the pool takes, which the client learns with the model card."""
from __future__ import annotations

import pytest

from laya_pool.client.errors import RequestFailed
from laya_pool.client.local import local_pool
from laya_pool.client.pool import Client
from laya_pool.client.semantics import QuestionError
from laya_pool.protocol.contract import Reason

pytestmark = pytest.mark.timeout(120)
NOUL = {"type": "noul", "instructions": "Is this urgent?"}


def test_client_errors_name_the_field_and_are_raised_before_sending(tiny_ckpt):
    with local_pool(tiny_ckpt, "cpu", heartbeat_ms=250, extra_args=["--max-rows", "4", "--threads", "1"]) as pool, \
            Client(pool.endpoint, timeout=10.0) as c:
        assert c.predict("ok", {f"q{i}": NOUL for i in range(4)})["answers"].keys() == {"q0", "q1", "q2", "q3"}
        assert c.capacity["max_rows"] == 4, "the capacity comes with the model card"

        def sent() -> int:
            return c.status()["broker"]["counters"].get("requests", 0)
        before = sent()
        with pytest.raises(RequestFailed) as e:
            c.predict("ok", {f"q{i}": NOUL for i in range(5)})
        assert e.value.field == "questions" and e.value.reason == Reason.TOO_LARGE
        assert "5 questions" in str(e.value) and "limit of 4" in str(e.value) and "split" in str(e.value)
        for state, kind, where in (({"ticket": b"raw"}, TypeError, "state['ticket'] is bytes"),
                                   ("broken \udc80 text", ValueError, "state is not valid Unicode"),
                                   ([{"role": "user", "content": "\ud800"}], ValueError, "state[0]['content']")):
            with pytest.raises(kind, match=where.replace("[", r"\[").replace("]", r"\]")):
                c.predict(state, {"q": NOUL})
        with pytest.raises(QuestionError) as q:
            c.predict("ok", {"team": {"type": "choice", "instructions": "who?", "criteria": {"it\ud800": "x"}}})
        assert q.value.qid == "team" and "definition['criteria'] key" in str(q.value)
        with pytest.raises(RequestFailed) as e:
            c.forward([(list(range(5, 15)), [1], 2)] * 5)
        assert e.value.field == "rows" and "5 rows" in str(e.value)
        assert sent() == before, "nothing may reach the pool for a request the client can refuse itself"
        assert c.predict("fine", {"q": NOUL})["answers"]["q"]["type"] == "noul"
