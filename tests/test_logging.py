"""Log lines about a request carry its id (client id + request id) in the broker and in the worker, and
`--log-format json` writes one object per line with that id as `request` (protocol/logs.py)."""
from __future__ import annotations

import json
import logging

from conftest import make_rows

from laya_pool.protocol import logs, wire


def test_the_worker_sees_the_clients_request_id():
    frames = wire.encode_request(17, wire.pack_rows(make_rows(1)), cid="c0ffee")
    at_broker = wire.parse_request(wire.decode(frames), need_cid=True)
    assert at_broker.tag == "c0ffee:17"
    forwarded = wire.encode(wire.Cmd.REQUEST, wire.request_header_for_worker(at_broker, 99001),
                            *wire.decode(frames).frames)
    at_worker = wire.parse_request(wire.decode(forwarded))
    assert at_worker.rid == 99001 and at_worker.cid is None       # the worker answers the broker's job id
    assert at_worker.tag == "c0ffee:17"                            # and logs the client's


def test_json_lines_carry_the_request_id():
    rec = logging.LogRecord("laya-pool.worker", logging.WARNING, __file__, 1, "worker %s: internal error on request %s",
                            ("0", "c0ffee:17"), None)
    rec.request = "c0ffee:17"
    out = json.loads(logs.JsonFormatter("worker 0").format(rec))
    assert out["request"] == "c0ffee:17" and out["process"] == "worker 0" and out["level"] == "WARNING"
    assert out["msg"] == "worker 0: internal error on request c0ffee:17"
    plain = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", (), None)
    assert "request" not in json.loads(logs.JsonFormatter("broker").format(plain))


def test_levels_and_formats_are_checked():
    assert logs.check_level("debug") == "DEBUG" and logs.check_format("JSON") == "json"
    for bad in ("loud", ""):
        try:
            logs.check_level(bad)
        except ValueError as e:
            assert "unknown log level" in str(e)
        else:
            raise AssertionError(bad)
