"""The wire protocol (protocol/wire.py): round trips, and strict refusal of everything else."""
from __future__ import annotations

import subprocess
import sys

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from laya_pool.protocol import wire
from laya_pool.protocol.wire import Cmd, ProtocolError

ROWS = [(np.array([1, 5, 9, 2], np.int32), np.array([1, 3], np.int32), 0),
        (np.array([7, 8, 9], np.int32), np.array([0], np.int32), 2)]


def _request(**kw) -> list:
    return [bytes(f) for f in wire.encode_request(7, wire.pack_rows(ROWS), cid="c1", **kw)]


def _msg(cmd: int, header: bytes, *payload) -> list:
    """A message as LAYA3 frames it: version, command and header in the first frame, then the payload frames."""
    return [wire.PROTOCOL + bytes([cmd]) + header, *payload]


def _header(frames: list) -> dict:
    return msgpack.unpackb(frames[0][wire.HEAD:], strict_map_key=False)


def _with_header(frames: list, header: dict) -> list:
    """`frames` with its header replaced (version, command and payload kept)."""
    return [frames[0][:wire.HEAD] + msgpack.packb(header), *frames[1:]]


def _raises(frames, field: str, parse=wire.parse_request):
    with pytest.raises(ProtocolError) as e:
        parse(wire.decode(frames))
    assert e.value.field == field, str(e.value)
    assert str(e.value).startswith(field)
    return e.value


def test_request_round_trip():
    frames = _request(worker="1", mode="eager", taps=True)
    assert frames[0][:wire.HEAD] == wire.PROTOCOL + bytes([Cmd.REQUEST])
    assert len(frames) == 2      # version, command and header; the arrays' one buffer
    req = wire.parse_request(wire.decode(frames), need_cid=True)
    assert (req.rid, req.cid, req.worker, req.mode, req.taps) == (7, "c1", "1", "eager", True)
    assert req.ids.tolist() == [1, 5, 9, 2, 7, 8, 9]
    assert req.lengths.tolist() == [4, 3] and req.types.tolist() == [0, 2]
    assert req.marker_counts.tolist() == [2, 1] and req.markers.tolist() == [1, 3, 0]
    assert all(a.dtype == np.dtype("<i4") for a in req.arrays().values())
    # the buffer is raw little-endian int32 (not msgpack): ids, lengths, types, marker counts, markers
    assert frames[1] == np.array([1, 5, 9, 2, 7, 8, 9, 4, 3, 0, 2, 2, 1, 1, 3, 0], "<i4").tobytes()


def test_reply_round_trip_with_taps():
    logits = np.array([0.5, -1.0, 2.0], np.float32)
    act = np.array([[0.25, 0.75], [0.5, 0.5]], np.float32)
    taps = {"final_norm": np.arange(12, dtype=np.float32).reshape(2, 3, 2)}
    frames = wire.encode_reply(3, logits, act, worker="0", fingerprint="ab", metrics={"mode": "eager",
                               "n": np.int64(4)}, taps=taps)
    rep = wire.parse_reply(wire.decode([bytes(f) for f in frames]))
    assert rep.status == "ok" and rep.rid == 3 and rep.worker == "0" and rep.fingerprint == "ab"
    assert rep.metrics == {"mode": "eager", "n": 4}
    np.testing.assert_array_equal(rep.logits, logits)
    np.testing.assert_array_equal(rep.act, act)
    np.testing.assert_array_equal(rep.taps["final_norm"], taps["final_norm"])


@pytest.mark.parametrize("n_group_metrics", [0, 3, 20, 250])
def test_a_groups_replies_decode_to_the_header_packed_whole(n_group_metrics):
    """`Replies` joins bytes packed apart: each reply's header must decode to exactly the map one `pack` of the
    whole makes, whatever the maps' sizes (fixmap and map16 headers, past the 256 metrics a reply carries), when a
    reply repeats a shared key, and when two of its keys become one string."""
    shared = {f"m{i}": (i * 0.5 if i % 2 else np.int32(i)) for i in range(n_group_metrics)}
    replies = wire.Replies(worker="w3", fingerprint="f" * 64, metrics=shared)
    act = np.zeros((2, 3), np.float32)
    for rid, own in [(7, {"queue_ms": 1.5, "received_at": 12.25}), ("x", None), (8, {"m1": "mine", "q": 1}),
                     (9, {f"o{i}": i for i in range(17)}), (10, {1: "a", "1": "b"}), (11, {"m2": 5, 2: 6}),
                     (12, {**{f"k{i}": i for i in range(256)}, "m1": "own"}), (13, {"m1": "own", 1: "a", "1": "b"})]:
        frames = [bytes(f) for f in replies.encode(rid, np.arange(5, dtype=np.float32), act, own)]
        header = _header(frames)
        metrics = wire.plain({**wire.plain(shared), **wire.plain(own or {})})
        whole = {"rid": rid, "markers": 5, "rows": 2, "n_act": 3, "status": "ok", "worker": "w3", "fp": "f" * 64,
                 **({"metrics": metrics} if metrics else {})}
        assert header == whole
        assert len(header.get("metrics", {})) == len(metrics)     # a repeated key is there once
        # a group's only reply, packed whole: the same bytes
        alone = wire.Replies(worker="w3", fingerprint="f" * 64, metrics=shared).alone(
            rid, np.arange(5, dtype=np.float32), act, own)
        assert [bytes(f) for f in alone] == frames
        rep = wire.parse_reply(wire.decode(frames))
        assert rep.rid == rid and rep.metrics == metrics


def test_error_replies():
    rep = wire.parse_reply(wire.decode(wire.encode_error(9, "final", "ids (row 1): token 5000 is outside",
                                                         field="ids", row=1)))
    assert (rep.status, rep.error["field"], rep.error["row"]) == ("final", "ids", 1)
    rep = wire.parse_reply(wire.decode(wire.encode_error("x", "retryable", "busy", reason="busy")))
    assert rep.status == "retryable" and rep.error["reason"] == "busy" and rep.rid == "x"
    with pytest.raises(ValueError):
        wire.encode_error(1, "ok", "not an error")


def test_a_budget_travels_in_the_header_and_is_checked():
    frames = wire.with_budget(_request(), 1500)
    req = wire.parse_request(wire.decode(frames), need_cid=True)
    assert req.budget_ms == 1500 and req.rid == 7 and req.ids.tolist() == [1, 5, 9, 2, 7, 8, 9]
    assert wire.parse_request(wire.decode(_request())).budget_ms is None        # no deadline
    # stamped again (a retry's budget): the last one counts; a header too large for a fixmap is re-encoded
    assert wire.decode(wire.with_budget(frames, 700)).header["budget_ms"] == 700
    big = wire.encode(Cmd.STATUS, {f"k{i}": i for i in range(20)})
    assert wire.decode(wire.with_budget(big, 5)).header == {**{f"k{i}": i for i in range(20)}, "budget_ms": 5}
    # the broker forwards what is left of it, under its own job id
    assert wire.request_header_for_worker(req, 42, 300)["budget_ms"] == 300
    assert "budget_ms" not in wire.request_header_for_worker(req, 42)
    for bad, field in ((-1, "budget_ms"), (wire.MAX_BUDGET_MS + 1, "budget_ms"), ("soon", "budget_ms")):
        header = _header(frames)
        header["budget_ms"] = bad
        _raises(_with_header(frames, header), field)


def test_retry_after_travels_in_the_error_in_milliseconds():
    rep = wire.parse_reply(wire.decode(wire.encode_error(1, "retryable", "busy", reason="busy", retry_after=0.25)))
    assert rep.error["retry_after_ms"] == 250 and wire.retry_after_of(rep.error) == 0.25
    assert wire.retry_after_of({"message": "x"}) is None and wire.retry_after_of({"retry_after_ms": True}) is None


def test_body_round_trip():
    frames = wire.encode_body_reply(Cmd.STATUS, 4, {"workers": [{"id": "0", "state": "ready"}]})
    msg = wire.decode(frames)
    assert wire.parse_any_reply(msg).status == "ok"
    assert wire.body_of(msg) == {"workers": [{"id": "0", "state": "ready"}]}


@pytest.mark.parametrize("frames, field", [
    ([b"garbage"], "version"),
    ([], "frames"),
    ([b"LAYA0" + bytes([2]) + msgpack.packb({})], "version"),
    ([b"LAYA2", bytes([2]), msgpack.packb({})], "version"),     # the version before this one: three frames
    ([b"LAYA1", bytes([2]), msgpack.packb({})], "version"),
    ([wire.PROTOCOL], "header"),
    (_msg(2, b""), "header"),
    (_msg(99, msgpack.packb({})), "command"),
    (_msg(2, b"\xc1\xc1"), "header"),
    (_msg(2, msgpack.packb([1, 2])), "header"),
    (_msg(2, msgpack.packb({1: 2})), "header"),
    (_msg(2, msgpack.packb(msgpack.ExtType(3, b"x"))), "header"),
    (_msg(2, msgpack.packb({"a": 1}) + b"junk"), "header"),
    (_msg(2, msgpack.packb({"s": "x" * (wire.MAX_HEADER_BYTES + 1)})), "header"),
    (_msg(2, msgpack.packb({}), *[b""] * 300), "frames"),
])
def test_envelope_refused(frames, field):
    with pytest.raises(ProtocolError) as e:
        wire.decode(frames)
    assert e.value.field == field, str(e.value)


def test_request_buffers_must_match_the_header():
    good = _request()
    short = list(good)
    short[1] = short[1][:-2]                                   # truncated
    e = _raises(short, "arrays")
    assert "holds 62 bytes" in str(e) and "need 64" in str(e)
    odd = list(good)
    odd[1] = odd[1] + b"\0\0\0\0"                             # one marker too many
    _raises(odd, "arrays")
    _raises(good[:-1], "frames")                               # the buffer missing
    _raises(good + [b""], "frames")                            # a buffer too many
    _raises(good[:1] + [good[1][:28], good[1][28:]], "frames")  # LAYA1's five buffers
    for key, value, field in [("rows", 3, "arrays"), ("rows", -1, "rows"), ("tokens", True, "tokens"),
                              ("markers", "3", "markers"), ("rows", wire.MAX_COUNT + 1, "rows"),
                              ("rid", None, "rid"), ("rid", 1.5, "rid"), ("mode", "turbo", "mode"),
                              ("taps", 1, "taps"), ("worker", 3, "worker"), ("cid", 5, "cid")]:
        h = _header(good)
        h[key] = value
        _raises(_with_header(good, h), field)
    h = _header(good)
    del h["cid"]
    with pytest.raises(ProtocolError) as e:
        wire.parse_request(wire.decode(_with_header(good, h)), need_cid=True)
    assert e.value.field == "cid"


def test_reply_buffers_must_match_the_header():
    frames = [bytes(f) for f in wire.encode_reply(1, np.ones(3, np.float32), np.ones((2, 2), np.float32))]
    bad = list(frames)
    bad[1] = bad[1][:8]
    _raises(bad, "logits", wire.parse_reply)
    bad = list(frames)
    bad[2] = bad[2] + b"\0" * 4
    _raises(bad, "act", wire.parse_reply)
    h = _header(frames)
    h["status"] = "maybe"
    _raises(_with_header(frames, h), "status", wire.parse_reply)
    h = _header(frames)
    h["taps"] = [["x", [2, 2]]]
    _raises(_with_header(frames, h), "frames", wire.parse_reply)
    err = [bytes(f) for f in wire.encode_error(1, "final", "no")]
    h = _header(err)
    del h["error"]
    _raises(_with_header(err, h), "error", wire.parse_reply)


def test_a_laya2_peer_is_refused_in_its_own_layout():
    """LAYA2 framed version, command and header as three frames: its peer cannot read a LAYA3 reply, so a refusal to
    it goes out in LAYA2's layout, naming `version` and its request id; any other refusal goes out as it is."""
    old = [wire.LAYA2, bytes([Cmd.REQUEST]), msgpack.packb({"rid": 9, "rows": 1}), b"\0" * 16]
    with pytest.raises(ProtocolError) as e:
        wire.decode(old)
    assert e.value.field == "version" and "LAYA3" in str(e.value)
    assert wire.rid_of(old) == 9
    reply = wire.in_kind(old, wire.encode_error(wire.rid_of(old), "final", str(e.value), field=e.value.field))
    assert reply[:2] == [wire.LAYA2, bytes([Cmd.REPLY])] and len(reply) == 3
    assert msgpack.unpackb(reply[2])["error"]["field"] == "version" and msgpack.unpackb(reply[2])["rid"] == 9
    refusal = wire.encode_error(None, "final", "x", field="version")
    assert wire.in_kind([b"garbage"], refusal) is refusal and wire.in_kind(_request(), refusal) is refusal


def test_the_positional_constructors_follow_the_field_order():
    """parse_request and the worker's admit build Request and Batch by position, for speed: their fields must stay in
    this order (a field added in between would shift every argument after it)."""
    from dataclasses import fields

    from laya_pool.worker.batch import Batch
    assert [f.name for f in fields(wire.Request)] == [*wire.REQUEST_ARRAYS, "rid", "cid", "worker", "mode", "taps",
                                                       "budget_ms", "header"]
    assert [f.name for f in fields(Batch)] == list(wire.REQUEST_ARRAYS)


def test_pack_rows_is_strict():
    with pytest.raises(ProtocolError):
        wire.pack_rows([(np.array([1.5, 2.0]), np.array([0]), 0)])          # float ids
    with pytest.raises(ProtocolError):
        wire.pack_rows([(np.array([1, 2]), np.array([0]), "choice")])       # qtype not an int
    with pytest.raises(ProtocolError):
        wire.pack_rows([(np.array([1 << 40]), np.array([0]), 0)])           # does not fit int32
    with pytest.raises(ProtocolError):
        wire.pack_rows([(np.array([object()]), np.array([0]), 0)])          # no objects, ever
    with pytest.raises(ProtocolError) as e:
        wire.pack_rows([(np.array([1], np.int32), np.array([0], np.int32), 0), (np.array([[1]]), np.array([0]), 0)])
    assert e.value.field == "rows[1].ids"                               # the field and the row, as before
    with pytest.raises(ProtocolError) as e:
        wire.pack_rows([(np.array([1], np.int32), np.array([0], np.int32), 1 << 31)])
    assert e.value.field == "types"
    empty = wire.pack_rows([])
    assert all(a.size == 0 and a.dtype == np.int32 for a in empty.values())


def test_pack_rows_one_row_and_many_agree():
    """One row is packed without copies (the arrays as given), several by concatenation: the same frame either way,
    whatever the rows' own dtypes."""
    a = (np.arange(5, dtype=np.int32), np.array([1, 3], np.int32), 2)
    b = ([7, 8, 9], np.array([0], np.int64), np.int64(1))
    one, other = wire.pack_rows([a]), wire.pack_rows([b])
    both = wire.pack_rows([a, b])
    assert not np.shares_memory(one["ids"], a[0]) and not np.shares_memory(one["markers"], a[1])   # the caller's own
    for k in wire.REQUEST_ARRAYS:
        assert both[k].dtype == one[k].dtype == np.int32
        assert both[k].tolist() == one[k].tolist() + other[k].tolist(), k
    assert bytes(wire.encode_request(1, both)[1]) == b"".join(bytes(x.data) for x in
                                                              (both[k] for k in wire.REQUEST_ARRAYS))


def test_no_pickle_and_no_torch():
    code = ("import sys, laya_pool.client, laya_pool.protocol.wire, laya_pool.client.pool, laya_pool.broker.broker, "
            "laya_pool.broker.cli, laya_pool.broker.supervisor; "
            "assert 'torch' not in sys.modules, 'torch imported'; "
            "from laya_pool.protocol import wire; from laya_pool.client import pool; "
            "import inspect; src = inspect.getsource(wire) + inspect.getsource(pool); "
            "assert 'import pickle' not in src and 'recv_pyobj' not in src and 'send_pyobj' not in src")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_loopback():
    for ep in ("tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://[::1]:5", "ipc:///tmp/x", "inproc://a",
               "tcp://127.0.0.2:9"):
        assert wire.is_loopback(ep), ep
    for ep in ("tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://10.1.2.3:5", "tcp://eth0:5", "udp://127.0.0.1:5"):
        assert not wire.is_loopback(ep), ep


@settings(max_examples=300, deadline=None)
@given(st.lists(st.binary(max_size=64), max_size=10))
def test_fuzz_only_protocol_errors(frames):
    """Whatever arrives, decoding either succeeds or raises ProtocolError: never another exception."""
    for prefix in (b"", wire.PROTOCOL + bytes([2]), wire.PROTOCOL + bytes([3])):
        try:
            msg = wire.decode([prefix + frames[0], *frames[1:]] if frames else [prefix])
            if msg.cmd == Cmd.REQUEST:
                wire.parse_request(msg)
            elif msg.cmd == Cmd.REPLY:
                wire.parse_reply(msg)
        except ProtocolError:
            pass


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.sampled_from(["rid", "rows", "tokens", "markers", "mode", "taps", "cid", "x"]),
                       st.one_of(st.integers(-5, 1 << 40), st.text(max_size=5), st.booleans(), st.none(),
                                 st.floats(allow_nan=True), st.lists(st.integers(-9, 1 << 40), max_size=3))),
       st.lists(st.binary(max_size=40), min_size=0, max_size=6))
def test_fuzz_request_headers(header, buffers):
    try:
        wire.parse_request(wire.decode(_msg(2, msgpack.packb(header), *buffers)))
    except ProtocolError:
        pass


def test_send_and_recv_frames_move_one_message_without_blocking():
    import zmq
    assert (wire.DONTWAIT, wire.SNDMORE) == (int(zmq.DONTWAIT), int(zmq.SNDMORE))
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    lonely = ctx.socket(zmq.DEALER)            # no peer: a blocking send would wait forever
    try:
        a.bind("inproc://send-frames")
        b.connect("inproc://send-frames")
        wire.send_frames(a, [b"one", b"", memoryview(b"three")])
        wire.send_frames(a, [b"alone"], copy=False, wait=True)
        assert wire.recv_frames(b) == [b"one", b"", b"three"]      # one message, frame by frame
        kept = wire.recv_frames(b, copy=False)
        assert [f.bytes for f in kept] == [b"alone"] and isinstance(kept[0], zmq.Frame)
        with pytest.raises(zmq.Again):
            wire.recv_frames(b)                                    # nothing left: it never blocks
        with pytest.raises(zmq.Again):
            wire.send_frames(lonely, [b"x", b"y"])
    finally:
        for s in (a, b, lonely):
            s.close(0)
        ctx.term()


def _request_outcome(frames: list, head: bool) -> tuple:
    """What a request parse says: the field it refuses, or the fields the broker routes by."""
    try:
        msg = wire.decode(frames)
        r = wire.parse_request_head(msg, need_cid=True) if head else wire.parse_request(msg, need_cid=True)
    except ProtocolError as e:
        return ("refused", e.field, str(e))
    return ("ok", r.rid, r.cid, r.rows, r.tokens, r.n_markers, r.worker, r.mode, r.taps, r.budget_ms, r.tag)


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(["rid", "rows", "tokens", "markers", "mode", "taps", "cid", "worker",
                                        "budget_ms", "req"]),
                       st.one_of(st.integers(-5, 12), st.integers(1 << 30, 1 << 40), st.text(max_size=5),
                                 st.booleans(), st.none(), st.sampled_from(wire.MODES))),
       st.lists(st.binary(max_size=48).filter(lambda b: len(b) % 4 == 0), min_size=1, max_size=2))
def test_the_brokers_request_head_checks_what_parse_request_checks(header, buffers):
    """The broker parses a request without its arrays (`parse_request_head`): same refusals, same fields."""
    frames = _msg(2, msgpack.packb(header), *buffers)
    assert _request_outcome(frames, head=True) == _request_outcome(frames, head=False)


_HEAD_VALUES = st.one_of(st.integers(-3, 12), st.sampled_from([wire.MAX_COUNT, wire.MAX_COUNT + 1,
                                                               wire.MAX_BUDGET_MS, wire.MAX_BUDGET_MS + 1]),
                         st.text(max_size=4), st.sampled_from(["x" * wire.MAX_STR, "x" * (wire.MAX_STR + 1), ""]),
                         st.booleans(), st.none(), st.floats(allow_nan=False), st.sampled_from(wire.MODES),
                         st.lists(st.integers(0, 3), max_size=2))


_HEAD_KEYS = ["rid", "rows", "tokens", "markers", "mode", "taps", "cid", "worker", "budget_ms", "req", "x"]
_GOOD_HEAD = {"rid": 7, "cid": "c1", "rows": 2, "tokens": 7, "markers": 3, "worker": "0", "mode": "eager",
              "taps": False, "budget_ms": 100}


@settings(max_examples=1500, deadline=None)
@given(st.dictionaries(st.sampled_from(_HEAD_KEYS), _HEAD_VALUES, max_size=3),
       st.lists(st.sampled_from(_HEAD_KEYS), max_size=2), st.booleans())
def test_the_plain_request_head_reads_what_the_checked_one_accepts(changes, dropped, need_cid):
    """`_plain_head` (the fast path every well-formed header takes) returns exactly the checked path's fields, and
    None wherever the checked path refuses: it never accepts what the checks refuse, nor reads a field otherwise.
    Headers are a good one with a few fields changed or dropped, so each rule meets values on both of its sides."""
    _same_head({k: v for k, v in {**_GOOD_HEAD, **changes}.items() if k not in dropped}, need_cid)


_HEAD_EDGES = [-1, 0, 1, wire.MAX_COUNT, wire.MAX_COUNT + 1, wire.MAX_BUDGET_MS, wire.MAX_BUDGET_MS + 1, "",
               "x" * wire.MAX_STR, "x" * (wire.MAX_STR + 1), True, False, 1.0, None, "eager", "bogus", [1], {}]


def test_the_plain_request_head_on_every_edge_of_every_field():
    """Each field of a good header set to each edge value (and dropped), alone: `_same_head` on every one."""
    for key in _HEAD_KEYS:
        for need_cid in (False, True):
            _same_head({k: v for k, v in _GOOD_HEAD.items() if k != key}, need_cid)
            for value in _HEAD_EDGES:
                _same_head({**_GOOD_HEAD, key: value}, need_cid)


def _same_head(header: dict, need_cid: bool) -> None:
    try:
        checked = wire._checked_head(header, need_cid)
    except ProtocolError:
        checked = None
    plain = wire._plain_head(header, need_cid)
    if checked is None:
        assert plain is None, (header, plain)
    else:
        assert plain is None or plain == checked, (header, plain, checked)
        assert plain is None or [type(v) for v in plain] == [type(v) for v in checked]


def test_every_header_a_client_sends_takes_the_plain_path():
    """The fast path is the one taken: the headers encode_request and with_budget build read plainly."""
    for frames in (_request(), _request(worker="0", mode="eager"), wire.with_budget(_request(), 0),
                   wire.with_budget(_request(taps=True), wire.MAX_BUDGET_MS)):
        h = wire.decode(frames).header
        plain = wire._plain_head(h, need_cid=True)
        assert plain is not None and plain == wire._checked_head(h, need_cid=True), h


def test_the_brokers_request_head_on_a_good_request():
    frames = wire.with_budget(_request(worker="0", mode="eager"), 1234)
    assert _request_outcome(frames, head=True) == _request_outcome(frames, head=False)
    assert _request_outcome(frames, head=True)[:6] == ("ok", 7, "c1", 2, 7, 3)


@pytest.mark.parametrize("cut,field", [(1, "logits"), (2, "act")])
def test_a_reply_checked_without_arrays_refuses_the_same_sizes(cut, field):
    frames = [bytes(f) for f in wire.encode_reply(1, np.ones(3, np.float32), np.ones((2, 2), np.float32))]
    assert wire.parse_reply(wire.decode(frames), arrays=False).logits is None
    bad = list(frames)
    bad[cut] = bad[cut][:4]
    _raises(bad, field, lambda m: wire.parse_reply(m, arrays=False))


# (header, kind, what get returns, or the field of the ProtocolError it raises)
GET = [
    ({"k": 5}, int, 5), ({"k": 0}, int, 0), ({"k": -1}, int, "k"), ({"k": True}, int, "k"),
    ({"k": True}, bool, True), ({"k": "x"}, str, "x"), ({"k": "x" * (wire.MAX_STR + 1)}, str, "k"),
    ({"k": 5}, (int, str), 5), ({"k": -5}, (int, str), "k"), ({"k": 1.5}, (int, str), "k"), ({}, int, "k"),
    ({"k": None}, int, "k"), ({"k": {}}, dict, {}), ({"k": 2}, float, "k"), ({"k": 2.5}, float, 2.5),
]


@pytest.mark.parametrize("header,kind,want", GET)
def test_get_takes_exact_types_and_refuses_the_rest(header, kind, want):
    if want == "k":
        with pytest.raises(ProtocolError) as e:
            wire.get(header, "k", kind)
        assert e.value.field == "k"
    else:
        assert wire.get(header, "k", kind) == want


def test_every_command_byte_decodes_to_its_command_and_no_other():
    for b in range(256):
        frames = _msg(b, msgpack.packb({}))
        if b in {int(c) for c in Cmd}:
            assert wire.decode(frames).cmd is Cmd(b)
        else:
            _raises(frames, "command", parse=lambda m: m)


def test_a_request_whose_per_row_arrays_disagree_is_not_sent():
    """One buffer is split by the header's counts, so arrays that disagree on the row count would be split wrong
    rather than refused: `encode_request` refuses them, naming the array."""
    arrays = wire.pack_rows(ROWS)
    for name in ("types", "marker_counts"):
        with pytest.raises(ProtocolError) as e:
            wire.encode_request(1, {**arrays, name: arrays[name][:1]})
        assert e.value.field == name


def _bundle_items(n: int, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    items = []
    for i in range(n):
        m, r = int(rng.integers(1, 9)), int(rng.integers(1, 4))
        items.append((100 + i if i % 3 else f"s{i}", rng.standard_normal(m).astype(np.float32),
                      rng.random((r, 2), dtype=np.float32), {"queue_ms": 0.5 * i, "worker_ms": 1.0 + i}))
    return items


@pytest.mark.parametrize("n", [1, 2, 8, 32])
def test_a_bundle_holds_exactly_the_replies_it_was_made_of(n):
    """`unbundle` gives, reply for reply, the header and the bytes `Replies.encode` would have sent alone."""
    metrics = {"mode": "graph-cached", "batched": 32, "queue_ms": 9.0, "shape": [32, 48, 4]}
    replies = wire.Replies(worker="w0", fingerprint="f" * 64, metrics=metrics)
    items = _bundle_items(n)
    frames = [bytes(f) for f in replies.bundle(items)]
    got = wire.unbundle(wire.decode(frames))
    assert len(got) == n
    for (rid, lg, ac, own), msg in zip(items, got):
        alone = wire.decode([bytes(f) for f in replies.encode(rid, lg, ac, own)])
        assert msg.cmd == alone.cmd == Cmd.REPLY and msg.header == alone.header, (msg.header, alone.header)
        assert [bytes(f) for f in msg.frames] == [bytes(f) for f in alone.frames]
        parsed = wire.parse_reply(msg)
        assert np.array_equal(parsed.logits, lg) and np.array_equal(parsed.act, ac)


@pytest.mark.parametrize("cut", ["logits", "act", "entry", "status", "frames", "empty"])
def test_a_bundle_that_does_not_add_up_is_refused_whole(cut):
    replies = wire.Replies(worker="w0", fingerprint="f" * 64, metrics={"batched": 3})
    frames = [bytes(f) for f in replies.bundle(_bundle_items(3))]
    h = _header(frames)
    if cut == "logits":
        frames[1] = frames[1][:-4]
    elif cut == "act":
        frames[2] = frames[2] + bytes(4)
    elif cut == "entry":
        h["replies"][1] = [101, 2]
    elif cut == "status":
        h["status"] = "final"
    elif cut == "frames":
        frames = frames[:2]
    else:
        h["replies"] = []
    if cut in ("entry", "status", "empty"):
        frames[0] = frames[0][:wire.HEAD] + msgpack.packb(h)
    field = {"logits": "logits", "act": "act", "entry": "replies", "status": "status", "frames": "frames",
             "empty": "replies"}[cut]
    _raises(frames, field, wire.unbundle)


def test_with_bundles_marks_a_request_and_keeps_the_rest():
    frames = wire.with_bundles(wire.with_budget(_request(), 250))
    h = wire.decode(frames).header
    assert wire.accepts_bundles(h) and h["budget_ms"] == 250 and h["rid"] == 7
    assert not wire.accepts_bundles(wire.decode(_request()).header)
    assert wire.parse_request(wire.decode(frames)).rows == wire.parse_request(wire.decode(_request())).rows


def _requests(n: int) -> list:
    rng = np.random.default_rng(n)
    out = []
    for i in range(n):
        rows = [(rng.integers(5, 900, int(rng.integers(3, 30))).astype(np.int32), np.array([1, 2], np.int32), i % 3)
                for _ in range(1 + i % 3)]
        frames = wire.encode_request(10 + i, wire.pack_rows(rows), cid="c1", mode="eager" if i % 2 else None)
        out.append(wire.with_bundles(wire.with_budget(frames, 100 + i)))
    return out


@pytest.mark.parametrize("n", [1, 2, 15, 16, 64])
def test_a_requests_message_splits_into_the_requests_it_was_made_of(n):
    """Header for header and buffer for buffer, each part parses as the request sent alone would."""
    requests = _requests(n)
    got = wire.split_requests(wire.decode([bytes(f) for f in wire.requests_message(requests)]))
    assert len(got) == n
    for frames, msg in zip(requests, got):
        alone = wire.decode([bytes(f) for f in frames])
        assert msg.cmd == alone.cmd == Cmd.REQUEST and msg.header == alone.header
        assert [bytes(f) for f in msg.frames] == [bytes(f) for f in alone.frames]
        a, b = wire.parse_request(msg, need_cid=True), wire.parse_request(alone, need_cid=True)
        assert all(np.array_equal(getattr(a, k), getattr(b, k)) for k in wire.REQUEST_ARRAYS) and a.rid == b.rid


@pytest.mark.parametrize("cut", ["short", "long", "counts", "not a map", "frames", "empty"])
def test_a_requests_message_that_does_not_split_is_refused_whole(cut):
    frames = [bytes(f) for f in wire.requests_message(_requests(3))]
    h = _header(frames)
    if cut == "short":
        frames[1] = frames[1][:-4]
    elif cut == "long":
        frames[1] = frames[1] + bytes(4)
    elif cut == "counts":
        h["requests"][1]["rows"] = -1
    elif cut == "not a map":
        h["requests"][2] = [1, 2]
    elif cut == "frames":
        frames = frames + [b""]
    else:
        h["requests"] = []
    if cut in ("counts", "not a map", "empty"):
        frames[0] = frames[0][:wire.HEAD] + msgpack.packb(h)
    field = {"short": "arrays", "long": "arrays", "counts": "rows", "not a map": "requests", "frames": "frames",
             "empty": "requests"}[cut]
    e = _raises(frames, field, wire.split_requests)
    rids = {"empty": [], "not a map": [10, 11]}.get(cut, [10, 11, 12])
    assert wire.rids_of_requests(wire.decode(frames)) == rids      # each of them is told why
    assert e.field == field


def test_only_plain_requests_travel_together():
    with pytest.raises(ProtocolError, match="requests"):
        wire.requests_message([])
    with pytest.raises(ProtocolError, match="requests"):
        wire.requests_message([wire.encode(Cmd.HEARTBEAT, {"rid": 1})])


_GOOD_REPLY = {"rid": 7, "markers": 3, "rows": 1, "n_act": 2, "status": "ok", "worker": "w0", "fp": "f" * 64,
               "together": True, "metrics": {"mode": "eager", "queue_ms": 0.5}}
_REPLY_EDGES = [-1, 0, 1, 3, wire.MAX_COUNT, wire.MAX_COUNT + 1, "", "x" * wire.MAX_STR, "x" * (wire.MAX_STR + 1),
                True, False, 1.0, None, "ok", "final", [1], {}, {"message": "m"}, [["t", [1]]]]


def _reply_outcome(header: dict) -> tuple:
    frames = [np.zeros(3, np.float32).tobytes(), np.zeros(2, np.float32).tobytes()]
    try:
        rep = wire.parse_reply(wire.Message(wire.Cmd.REPLY, header, frames))
    except ProtocolError as e:
        return ("refused", e.field)
    return ("ok", rep.rid, type(rep.rid), rep.status, rep.worker, rep.fingerprint, rep.metrics, rep.error,
            None if rep.logits is None else rep.logits.tolist(), None if rep.act is None else rep.act.tolist())


def test_the_plain_reply_path_reads_what_the_checked_one_accepts(monkeypatch):
    """`_plain_ok_reply` (the path every ok reply without taps takes) gives `parse_reply` exactly what its checks
    give, and refuses nothing they accept: each field of a good reply set to each edge value (and dropped), read
    both ways. The checked way is `parse_reply` with the plain path turned off."""
    headers = [dict(_GOOD_REPLY)]
    for key in (*_GOOD_REPLY, "taps", "error"):
        headers.append({k: v for k, v in _GOOD_REPLY.items() if k != key})
        headers += [{**_GOOD_REPLY, key: value} for value in _REPLY_EDGES]
    fast = [_reply_outcome(h) for h in headers]
    assert wire._plain_ok_reply(_GOOD_REPLY) is not None                    # (the good one takes the plain path)
    monkeypatch.setattr(wire, "_plain_ok_reply", lambda h: None)
    checked = [_reply_outcome(h) for h in headers]
    for h, a, b in zip(headers, fast, checked):
        assert a == b, (h, a, b)
    assert sum(o[0] == "ok" for o in checked) > 20 and sum(o[0] == "refused" for o in checked) > 20


def test_every_reply_a_worker_sends_takes_the_plain_path():
    """A group's only reply, one of several, and each reply a bundle holds: all read on the plain path."""
    replies = wire.Replies(worker="0", fingerprint="f" * 64, together=True, metrics={"batched": 2})
    lg, ac, own = np.zeros(4, np.float32), np.zeros((1, 2), np.float32), {"queue_ms": 0.1}
    messages = [wire.decode([bytes(f) for f in replies.alone(3, lg, ac, own)]),
                wire.decode([bytes(f) for f in replies.encode(4, lg, ac, own)]),
                *wire.unbundle(wire.decode([bytes(f) for f in replies.bundle([(5, lg, ac, own), (6, lg, ac, None)])]))]
    for msg in messages:
        assert wire._plain_ok_reply(msg.header) is not None, msg.header
        assert wire.parse_reply(msg).status == "ok"
