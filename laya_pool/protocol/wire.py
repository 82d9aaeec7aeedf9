"""The laya-pool wire protocol: the one module the client, the broker and the workers all import.

A message is a list of ZeroMQ frames (after the ROUTER envelope, which this module never sees):

    [b"LAYA3" + command (1 byte) + msgpack header (a map), payload frames ...]

Payload frames are raw little-endian int32 / float32 buffers (request arrays, reply logits) or one
msgpack "body" frame (status tables, the model card). Nothing is ever pickled. Decoding is strict:
a wrong version, an unknown command, a header that is not a small msgpack map of the expected keys
and types, a missing or extra frame, or a buffer whose size does not match the header's counts raise
`ProtocolError` naming the problem. See docs/protocol.md for the full description.

Pure Python + numpy + msgpack: no zmq, no torch, so every process (and `import client`) can import it.
The facts around the format (modes, reasons, exit codes, defaults) are in `protocol.contract`.
"""
from __future__ import annotations

import enum
import ipaddress
import itertools
import os
import secrets
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from .contract import MODES

# LAYA3: the version, the command and the header in one frame (LAYA2: three), two frames fewer for every hop to read
# and write; LAYA2: a REQUEST's five arrays travel in one frame (LAYA1: five).
PROTOCOL = b"LAYA3"
HEAD = len(PROTOCOL) + 1        # the bytes before the header in a message's first frame: version, command
LAYA2 = b"LAYA2"                # the version before: its peers' refusals go out in its layout (`in_kind`)

# Limits. The header is small by construction; bodies carry a model card (tokenizer.json, a few MB).
MAX_HEADER_BYTES = 64 * 1024
MAX_BODY_BYTES = 64 * 1024 * 1024
MAX_STR = 4096                  # a header string (ids, modes, messages)
MAX_COUNT = 1 << 26             # any row / token / marker count on the wire (a sanity bound, not a capacity)
MAX_TAPS = 256
MAX_METRIC_ITEMS = 256
MAX_BUNDLE = 1024               # replies in one BUNDLE (a worker sends at most 64: worker/compute.py)
MAX_TOGETHER = 256              # requests in one REQUESTS message (a client sends at most 64: client/direct_async.py)
MAX_BUDGET_MS = 24 * 3600 * 1000   # a request's time budget (`budget_ms`): a day is more than any caller waits

I32 = np.dtype("<i4")
F32 = np.dtype("<f4")

STATUS_OK = "ok"
STATUS_RETRYABLE = "retryable"   # try again (same request id): busy, worker lost, worker stopping, no workers
STATUS_FINAL = "final"           # do not retry: the request itself is wrong (names field and row)
STATUSES = (STATUS_OK, STATUS_RETRYABLE, STATUS_FINAL)

# A REQUEST's arrays, back to back in this order in its one payload frame (`ARRAYS`): int32, their lengths the
# header's counts T, R, R, R, M.
REQUEST_ARRAYS = ("ids", "lengths", "types", "marker_counts", "markers")
ARRAYS = "arrays"


class Cmd(enum.IntEnum):
    READY = 1        # worker -> broker: register (id, device, fingerprint, capacity, pid)
    REQUEST = 2      # client -> broker -> worker: one group of rows
    REPLY = 3        # worker -> broker -> client: logits + act, or an error
    HEARTBEAT = 4    # both ways between broker and worker; client -> broker is a ping
    DISCONNECT = 5   # broker -> worker: re-register; worker -> broker: leaving
    STATUS = 6       # client -> broker: the pool's state (reply carries a body)
    DRAIN = 7        # client -> broker: drain (and optionally restart) a worker; broker -> worker: drain
    DESCRIBE = 8     # client -> broker -> worker: the model card (reply carries a body)
    RELOAD = 9       # operator -> broker: roll the pool onto another checkpoint (the supervisor carries it out)
    LANE = 10        # client -> worker's direct socket: take requests on a lane (protocol/lane.py); back: taken / ring
    BUNDLE = 11      # worker's direct socket -> client: the ok replies of one forward to that client's requests
    REQUESTS = 12    # client -> worker's direct socket: several REQUESTs of one client in one message


# The command of each byte value (None: unknown): a table lookup instead of `Cmd(byte)`, an enum call per message.
_CMD_OF_BYTE: tuple[Cmd | None, ...] = tuple({int(c): c for c in Cmd}.get(b) for b in range(256))


# Each command's first bytes (version and command), built once (`encode` runs for every message the broker sends).
_HEADS: tuple[bytes, ...] = tuple(PROTOCOL + bytes((b,)) for b in range(256))


class ProtocolError(ValueError):
    """A message that does not follow this protocol; `field` names the part that is wrong."""

    def __init__(self, field: str, message: str):
        self.field, self.message = field, message
        super().__init__(f"{field}: {message}")


# ---------------------------------------------------------------------------------------------- msgpack

_PACKERS = threading.local()   # a Packer is not thread-safe; one per thread packs 2x faster than `packb` makes one


def pack(obj: Any) -> bytes:
    try:
        packer = _PACKERS.packer
    except AttributeError:
        packer = _PACKERS.packer = msgpack.Packer(use_bin_type=True)
    try:
        out = packer.pack(obj)
    except (TypeError, ValueError, OverflowError) as e:
        _PACKERS.packer = msgpack.Packer(use_bin_type=True)    # nothing half-packed carries over
        raise ProtocolError("header", f"cannot encode {type(obj).__name__}: {e}") from e
    if len(out) > MAX_HEADER_BYTES:
        del _PACKERS.packer        # a body (a model card: MBs): its buffer is not kept for the thread's headers
    return out


def unpack(data: Any, limit: int, what: str = "header") -> Any:
    """msgpack-decode `data` with hard bounds: no ext types, string keys only, sizes within `limit`."""
    buf = _bytes(data)
    if len(buf) > limit:
        raise ProtocolError(what, f"{len(buf)} bytes exceed the limit of {limit}")
    if not buf:
        raise ProtocolError(what, "empty frame")
    try:
        return msgpack.unpackb(buf, raw=False, strict_map_key=True, use_list=True,
                               max_str_len=limit, max_bin_len=limit, max_array_len=min(limit, 1 << 20),
                               max_map_len=min(limit, 1 << 16), max_ext_len=0)
    except msgpack.ExtraData as e:
        raise ProtocolError(what, "trailing bytes after the msgpack value") from e
    except Exception as e:  # msgpack raises several types for garbage (FormatError, StackError, ValueError ...)
        raise ProtocolError(what, f"not valid msgpack ({type(e).__name__}: {e})") from e


def _bytes(frame: Any) -> bytes | memoryview:
    if isinstance(frame, (bytes, bytearray, memoryview)):
        return frame
    if hasattr(frame, "buffer"):   # zmq.Frame
        return frame.buffer
    return memoryview(frame)


def _nbytes(frame: Any) -> int:
    b = _bytes(frame)
    return b.nbytes if isinstance(b, memoryview) else len(b)


# ---------------------------------------------------------------------------------------------- messages

@dataclass
class Message:
    cmd: Cmd
    header: dict[str, Any]
    frames: list[Any] = field(default_factory=list)   # payload frames (bytes / zmq.Frame / memoryview)


# libzmq's ZMQ_DONTWAIT and ZMQ_SNDMORE (fixed by its ABI; tests/test_wire.py checks them against pyzmq's), as plain
# ints: pyzmq's enum flags cost an enum operation per frame in send_multipart, more than the send itself in a
# profile of the broker's routed path (136,000 enum calls for 4,289 forwards).
DONTWAIT = 1
SNDMORE = 2


def send_frames(sock: Any, frames: Sequence[Any], copy: bool = True, wait: bool = False) -> None:
    """One multipart message; without `wait`, zmq.Again if the first frame cannot go now (unroutable, or the peer's
    queue is full). Once the first frame is taken, ZeroMQ takes the rest."""
    first = 0 if wait else DONTWAIT
    send = sock.send
    for f in frames[:-1]:
        send(f, first | SNDMORE, copy=copy)
    send(frames[-1], first, copy=copy)


def recv_frames(sock: Any, copy: bool = True) -> list[Any]:
    """One multipart message without blocking (zmq.Again if none): bytes, or zmq.Frames without `copy`. Each frame
    says whether more follow, so no RCVMORE option is read per frame (pyzmq looks every option up through an enum):
    4.0 against 6.0 us for a 7-frame message (recv_multipart, this CPU). The rest of a message is there once its
    first frame is."""
    f = sock.recv(DONTWAIT, copy=False)
    parts = [f.bytes if copy else f]
    while f.more:
        f = sock.recv(DONTWAIT, copy=False)
        parts.append(f.bytes if copy else f)
    return parts


def encode(cmd: Cmd, header: dict[str, Any], *frames: Any) -> list[Any]:
    """Frames for one message; payload frames are passed through untouched (zero copy)."""
    return _framed(cmd, pack(header), frames)


def _framed(cmd: Cmd, header: bytes, frames: Sequence[Any]) -> list[Any]:
    if len(header) > MAX_HEADER_BYTES:
        raise ProtocolError("header", f"{len(header)} bytes exceed the limit of {MAX_HEADER_BYTES}")
    return [_HEADS[cmd] + header, *frames]


def decode(frames: Sequence[Any], max_frames: int = 6 + MAX_TAPS) -> Message:
    """Parse the first frame (version, command, header); payload frames are checked by the caller."""
    n = len(frames)
    if n < 1:
        raise ProtocolError("frames", "an empty message")
    if n > max_frames:
        raise ProtocolError("frames", f"{n} frames exceed the limit of {max_frames}")
    first = _bytes(frames[0])
    # A bytes frame (what the broker receives) compares as it is; a zmq.Frame's buffer through its first bytes.
    if not (first.startswith(PROTOCOL) if isinstance(first, bytes) else bytes(first[:HEAD - 1]) == PROTOCOL):
        if bytes(first[:4]) == PROTOCOL[:4]:
            raise ProtocolError("version", f"expected protocol {PROTOCOL.decode()}, got {_show(frames[0])}")
        raise ProtocolError("version", f"not a laya-pool message (first frame {_show(frames[0])})")
    if len(first) <= HEAD:
        raise ProtocolError("header", f"the first frame ends after {len(first)} bytes: no command or no header")
    if len(first) - HEAD > MAX_HEADER_BYTES:      # before the slice below copies it
        raise ProtocolError("header", f"{len(first) - HEAD} bytes exceed the limit of {MAX_HEADER_BYTES}")
    cmd = _CMD_OF_BYTE[first[HEAD - 1]]
    if cmd is None:
        raise ProtocolError("command", f"unknown command {first[HEAD - 1]}")
    header = unpack(first[HEAD:], MAX_HEADER_BYTES)      # (bytes: a short copy; a frame's buffer: a view)
    if not isinstance(header, dict):
        raise ProtocolError("header", f"must be a msgpack map, got {type(header).__name__}")
    return Message(cmd, header, list(frames[1:]))


def in_kind(incoming: Sequence[Any], reply: list[Any]) -> list[Any]:
    """`reply` (a refusal) to the message `incoming`, which did not decode: in LAYA2's layout (version, command and
    header as three frames) when a LAYA2 peer sent it, so that the peer reads the `version` error instead of failing
    on the framing (or dropping the reply); otherwise as it is."""
    if len(incoming) >= 3 and _is_laya2(incoming[0]):
        head = bytes(_bytes(reply[0]))
        return [LAYA2, head[HEAD - 1:HEAD], head[HEAD:], *reply[1:]]
    return reply


def _is_laya2(frame: Any) -> bool:
    """Whether `frame` is LAYA2's version frame (compared without copying a frame of any other size)."""
    b = _bytes(frame)
    return len(b) == len(LAYA2) and bytes(b) == LAYA2


def _show(frame: Any) -> str:
    b = bytes(_bytes(frame)[:16])
    return repr(b) + ("..." if _nbytes(frame) > 16 else "")


# ---------------------------------------------------------------------------------------------- header fields

_MISSING = object()


def get(header: dict, key: str, kind: type | tuple, *, default: Any = _MISSING, what: str = "header") -> Any:
    """`header[key]`, checked: right type (bool is never an int), strings bounded, ints non-negative."""
    # The common case first, a value of exactly the one type asked for (the broker reads ~10 fields a message);
    # a tuple of kinds, a bool, a missing key, anything to refuse takes the full checks below.
    v = header.get(key)
    t = type(v)
    if t is kind and (t is not int or v >= 0) and (t is not str or len(v) <= MAX_STR):
        return v
    if v is None:
        if default is _MISSING:
            raise ProtocolError(key, f"missing from the {what}")
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(v, bool) and bool not in kinds:
        raise ProtocolError(key, f"must be {_kind_name(kinds)}, got a bool")
    if not isinstance(v, kinds):
        raise ProtocolError(key, f"must be {_kind_name(kinds)}, got {type(v).__name__}")
    if isinstance(v, str) and len(v) > MAX_STR:
        raise ProtocolError(key, f"string of {len(v)} characters exceeds {MAX_STR}")
    if isinstance(v, int) and not isinstance(v, bool) and v < 0:
        raise ProtocolError(key, f"must not be negative, got {v}")
    return v


def _kind_name(kinds: tuple) -> str:
    return " or ".join({int: "an integer", str: "a string", bool: "a bool", dict: "a map", list: "a list",
                        float: "a number"}.get(k, k.__name__) for k in kinds)


def _count(header: dict, key: str) -> int:
    v = get(header, key, int)
    if v > MAX_COUNT:
        raise ProtocolError(key, f"{v} exceeds the wire limit of {MAX_COUNT}")
    return v


def _check_size(frame: Any, dtype: np.dtype, count: int, name: str) -> Any:
    """The frame's buffer, once its byte size is exactly `count` items of `dtype`."""
    buf = _bytes(frame)
    n = buf.nbytes if isinstance(buf, memoryview) else len(buf)
    if n != count * dtype.itemsize:
        raise ProtocolError(name, f"buffer holds {n} bytes; the header's count {count} needs "
                                  f"{count * dtype.itemsize} ({dtype.itemsize}-byte {dtype.kind}{dtype.itemsize * 8})")
    return buf


def _array(frame: Any, dtype: np.dtype, count: int, name: str) -> np.ndarray:
    return np.frombuffer(_check_size(frame, dtype, count, name), dtype=dtype, count=count)


def _as_is(a: Any, dtype: np.dtype, ndim: int) -> bool:
    """`a` is a contiguous array of `dtype` and `ndim` (what our own code passes): it needs no check or conversion."""
    return type(a) is np.ndarray and a.dtype == dtype and a.ndim == ndim and a.flags.c_contiguous


def _i32(a: Any, name: str) -> np.ndarray:
    if _as_is(a, I32, 1):
        return a
    arr = np.asarray(a)
    if arr.ndim != 1:
        raise ProtocolError(name, f"must be 1-D, got shape {arr.shape}")
    if arr.size and arr.dtype.kind not in "iu":
        raise ProtocolError(name, f"must hold integers, got {arr.dtype}")
    # Integers of 4 bytes or fewer (other than uint32) fit by their type: no pass over the values. Rows are
    # int32 already, and every request packs them twice (`pack_rows`, then `encode_request`).
    fits = arr.dtype.itemsize < 4 or (arr.dtype.itemsize == 4 and arr.dtype.kind == "i")
    if arr.size and not fits and (arr.min() < -(1 << 31) or arr.max() >= (1 << 31)):
        raise ProtocolError(name, "values do not fit in int32")
    return np.ascontiguousarray(arr, dtype=I32)


def _rid(header: dict) -> int | str:
    return get(header, "rid", (int, str))


def rid_of(frames: Sequence[Any]) -> Any:
    """Best effort: the request id of a message we otherwise refuse, so the error reply can name it."""
    try:
        first = memoryview(_bytes(frames[0]))
        if len(frames) >= 3 and _is_laya2(first):
            h = unpack(frames[2], MAX_HEADER_BYTES)         # LAYA2's header frame
        elif bytes(first[:HEAD - 1]) == PROTOCOL:
            h = unpack(first[HEAD:], MAX_HEADER_BYTES)
        else:
            return None
        rid = h.get("rid") if isinstance(h, dict) else None
        return rid if isinstance(rid, (int, str)) and not isinstance(rid, bool) else None
    except Exception:
        return None


# ---------------------------------------------------------------------------------------------- requests

@dataclass
class Rows:
    """The five arrays of one request's rows: what the client packs, the wire carries and the worker runs."""
    ids: np.ndarray            # int32 [T], rows back to back
    lengths: np.ndarray        # int32 [R]
    types: np.ndarray          # int32 [R]
    marker_counts: np.ndarray  # int32 [R]
    markers: np.ndarray        # int32 [M], positions inside their row, rows in order

    @property
    def rows(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def tokens(self) -> int:
        return int(self.ids.shape[0])

    @property
    def n_markers(self) -> int:
        return int(self.markers.shape[0])

    def arrays(self) -> dict[str, np.ndarray]:
        return {k: getattr(self, k) for k in REQUEST_ARRAYS}


@dataclass
class Request(Rows):
    rid: int | str
    cid: str | None
    worker: str | None = None  # run on this worker only
    mode: str | None = None    # override the worker's execution mode
    taps: bool = False         # return intermediate activations (eager only)
    budget_ms: int | None = None   # the caller's time left when it was sent; None: no deadline
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def tag(self) -> str:
        """The request's id for log lines, `CLIENT_ID:REQUEST_ID`, the same in the broker's and the worker's
        logs (the broker forwards it as `req`, since the worker sees only the broker's job id as rid)."""
        return _tag(self.header, self.cid, self.rid)


def _tag(header: dict[str, Any], cid: str | None, rid: int | str) -> str:
    forwarded = header.get("req")
    if isinstance(forwarded, str):
        return forwarded[:80]
    return f"{cid}:{rid}" if cid else f"job {rid}"


def pack_rows(rows: Iterable[tuple[Any, Any, int]]) -> dict[str, np.ndarray]:
    """`(ids, markers, qtype)` rows -> the five request arrays."""
    ids, mks, types = [], [], []
    for i, r in enumerate(rows):
        ids.append(_row_i32(r[0], i, "ids"))
        mks.append(_row_i32(r[1], i, "markers"))
        q = r[2]
        if isinstance(q, bool) or not isinstance(q, (int, np.integer)):
            raise ProtocolError(f"rows[{i}].qtype", f"must be an integer, got {type(q).__name__}")
        q = int(q)
        if not -(1 << 31) <= q < (1 << 31):
            raise ProtocolError("types", "values do not fit in int32")
        types.append(q)
    return {"ids": _joined(ids), "lengths": np.array([len(x) for x in ids], I32), "types": np.array(types, I32),
            "marker_counts": np.array([len(m) for m in mks], I32), "markers": _joined(mks)}


def _row_i32(a: Any, i: int, part: str) -> np.ndarray:
    """`_i32` of row `i`'s `part`, its name written only for an error (a request packs two a row)."""
    if _as_is(a, I32, 1):
        return a
    return _i32(a, f"rows[{i}].{part}")


def _joined(parts: list[np.ndarray]) -> np.ndarray:
    # Always a copy, as `concatenate` makes: the asyncio client encodes after an await, and the rows are the caller's.
    if len(parts) == 1:
        return parts[0].copy()
    return np.concatenate(parts) if parts else np.zeros(0, I32)


def encode_request(rid: int | str, arrays: dict[str, Any], *, cid: str | None = None, worker: str | None = None,
                   mode: str | None = None, taps: bool = False, extra: dict | None = None) -> list[Any]:
    """A REQUEST message. `arrays` holds the five int32 arrays (see `pack_rows`), sent back to back in one frame."""
    a = [_i32(arrays[k], k) for k in REQUEST_ARRAYS]
    rows = int(a[1].shape[0])
    for name, x in (("types", a[2]), ("marker_counts", a[3])):
        if x.shape[0] != rows:      # one buffer: its split comes from the counts, so they must agree here
            raise ProtocolError(name, f"has {x.shape[0]} entries for {rows} rows")
    header: dict[str, Any] = {"rid": rid, "rows": rows, "tokens": int(a[0].shape[0]), "markers": int(a[4].shape[0])}
    if cid is not None:
        header["cid"] = cid
    if worker is not None:
        header["worker"] = str(worker)
    if mode is not None:
        header["mode"] = mode
    if taps:
        header["taps"] = True
    if extra:
        header.update(extra)
    return encode(Cmd.REQUEST, header, b"".join([x.data for x in a]))


def request_bytes(rows: int, tokens: int, markers: int) -> int:
    """The size of a REQUEST's payload frame."""
    return (tokens + 3 * rows + markers) * I32.itemsize


class RequestHead:
    """A REQUEST checked as `parse_request` checks it, without its arrays: what the broker routes by. Its payload
    frames are forwarded untouched, so the broker builds no array for them (a plain class with slots: one is
    made per request)."""

    __slots__ = ("rid", "cid", "rows", "tokens", "n_markers", "worker", "mode", "taps", "budget_ms", "header")

    def __init__(self, rid: int | str, cid: str | None, rows: int, tokens: int, n_markers: int, worker: str | None,
                 mode: str | None, taps: bool, budget_ms: int | None, header: dict[str, Any]):
        self.rid, self.cid, self.rows, self.tokens, self.n_markers = rid, cid, rows, tokens, n_markers
        self.worker, self.mode, self.taps, self.budget_ms, self.header = worker, mode, taps, budget_ms, header

    @property
    def tag(self) -> str:
        return _tag(self.header, self.cid, self.rid)


def _plain_id(v: Any) -> bool:
    """A request id as `get(h, "rid", (int, str))` takes it, of exactly its type (the fast paths below)."""
    t = type(v)
    return (t is int and v >= 0) or (t is str and len(v) <= MAX_STR)


def _plain_counts(a: Any, b: Any, c: Any) -> bool:
    """Three counts as `_count` takes them, each exactly an int."""
    return (type(a) is int and type(b) is int and type(c) is int
            and 0 <= a <= MAX_COUNT and 0 <= b <= MAX_COUNT and 0 <= c <= MAX_COUNT)


def _plain_str(v: Any) -> bool:
    """An optional string field as `get(h, key, str, default=None)` takes it."""
    return v is None or (type(v) is str and len(v) <= MAX_STR)


def _plain_head(h: dict, need_cid: bool) -> tuple | None:
    """A request header's fields when each is of exactly its type and within its bounds (every header a client of
    ours sends), read without a `get` call per field: 1 us a request less for the broker and the worker alike. None
    for anything else, which `_checked_head` then refuses with the field's name, or accepts as this would have
    (tests/test_wire.py holds the two to each other)."""
    g = h.get
    rid, cid, rows, tokens, markers = g("rid"), g("cid"), g("rows"), g("tokens"), g("markers")
    worker, mode, taps, budget_ms = g("worker"), g("mode"), g("taps"), g("budget_ms")
    if not _plain_id(rid):
        return None
    if cid is None:
        if need_cid:
            return None
    elif type(cid) is not str or len(cid) > MAX_STR or (need_cid and not cid):
        return None
    if not _plain_counts(rows, tokens, markers) or not _plain_str(worker):
        return None
    if mode is not None and (type(mode) is not str or mode not in MODES):
        return None
    if taps is None:
        taps = False
    elif type(taps) is not bool:
        return None
    if budget_ms is not None and (type(budget_ms) is not int or not 0 <= budget_ms <= MAX_BUDGET_MS):
        return None
    return rid, cid, rows, tokens, markers, worker, mode, taps, budget_ms


def _checked_head(h: dict, need_cid: bool) -> tuple:
    """`_plain_head`'s fields, each checked on its own: the first one wrong raises, naming it."""
    rid = _rid(h)
    cid = get(h, "cid", str, default=None)
    if need_cid and not cid:
        raise ProtocolError("cid", "missing from the header (a client id is needed to deduplicate retries)")
    rows, tokens, markers = _count(h, "rows"), _count(h, "tokens"), _count(h, "markers")
    worker = get(h, "worker", str, default=None)
    mode = get(h, "mode", str, default=None)
    if mode is not None and mode not in MODES:
        raise ProtocolError("mode", f"must be one of {MODES}, got {mode!r}")
    taps = get(h, "taps", bool, default=False)
    return rid, cid, rows, tokens, markers, worker, mode, taps, budget_of(h)


def parse_request_head(msg: Message, need_cid: bool = False) -> RequestHead:
    """Check a REQUEST's header, and its buffer's size against the header's counts."""
    if msg.cmd != Cmd.REQUEST:
        raise ProtocolError("command", f"expected REQUEST, got {msg.cmd.name}")
    h = msg.header
    fields = _plain_head(h, need_cid) or _checked_head(h, need_cid)
    rid, cid, rows, tokens, markers, worker, mode, taps, budget_ms = fields
    frames = msg.frames
    if len(frames) != 1:
        raise ProtocolError("frames", f"a request carries one buffer ({', '.join(REQUEST_ARRAYS)} back to back), "
                                      f"got {len(frames)}")
    n = _nbytes(frames[0])
    if n != request_bytes(rows, tokens, markers):
        raise ProtocolError(ARRAYS, f"the buffer holds {n} bytes; the header's counts (tokens {tokens}, rows {rows}, "
                                    f"markers {markers}) need {request_bytes(rows, tokens, markers)}")
    return RequestHead(rid, cid, rows, tokens, markers, worker, mode, taps, budget_ms, h)


def parse_request(msg: Message, need_cid: bool = False) -> Request:
    """Check a REQUEST's header and its buffer against each other; the five arrays are zero-copy views of it."""
    head = parse_request_head(msg, need_cid)
    t, r = head.tokens, head.rows
    flat = np.frombuffer(_bytes(msg.frames[0]), dtype=I32)
    # positional, in the dataclass's field order (Rows' five arrays, then Request's own): 0.4 us less than by name
    return Request(flat[:t], flat[t:t + r], flat[t + r:t + 2 * r], flat[t + 2 * r:t + 3 * r], flat[t + 3 * r:],
                   head.rid, head.cid, head.worker, head.mode, head.taps, head.budget_ms, head.header)


def request_header_for_worker(req: Request | RequestHead, job: int, budget_ms: int | None = None) -> dict[str, Any]:
    """The header the broker forwards: its own job id as rid, the client's cid dropped (its `CID:RID` kept as `req`,
    for log lines), the time left, and the worker a request is addressed to (a draining worker runs such a request
    rather than hand it back: no other worker may)."""
    h = {"rid": job, "rows": req.rows, "tokens": req.tokens, "markers": req.n_markers, "req": req.tag}
    if req.worker is not None:
        h["worker"] = req.worker
    if req.mode is not None:
        h["mode"] = req.mode
    if req.taps:
        h["taps"] = True
    if budget_ms is not None:
        h["budget_ms"] = budget_ms
    return h


# ---------------------------------------------------------------------------------------------- deadlines
#
# A deadline travels as a budget: the milliseconds the caller has left when it sends (`budget_ms` in the
# header). Each hop turns it into a deadline on its own monotonic clock when the message arrives, and hands on
# what is left when it forwards. Only durations cross hosts, so clocks that disagree (or jump) change nothing;
# the transit time is the error, and it only ever makes a hop hold work a little longer than the caller waits.

def budget_of(header: dict) -> int | None:
    """The header's `budget_ms`, checked (a non-negative integer of at most a day), or None."""
    b = get(header, "budget_ms", int, default=None)
    if b is not None and b > MAX_BUDGET_MS:
        raise ProtocolError("budget_ms", f"{b} exceeds the limit of {MAX_BUDGET_MS} (a day)")
    return b


def with_budget(frames: Sequence[Any], budget_ms: int) -> list[Any]:
    """The message `frames` (as `encode` built them) with `budget_ms` set in its header; payloads untouched."""
    return _with_field(frames, "budget_ms", max(0, min(int(budget_ms), MAX_BUDGET_MS)))


BUNDLE = "bundle"       # a request header's flag: its client reads BUNDLEs (`accepts_bundles`)


def with_bundles(frames: Sequence[Any]) -> list[Any]:
    """A request that says its client reads BUNDLEs: the worker may answer it with others of the same client's
    requests in one message (docs/protocol.md, "Bundles")."""
    return _with_field(frames, BUNDLE, True)


def accepts_bundles(header: dict) -> bool:
    return header.get(BUNDLE) is True


TOGETHER = "together"    # an ok reply's flag: its worker takes REQUESTS messages (`Replies(together=True)`)
_REQUESTS_MAP = b"\x81" + msgpack.packb("requests")


def requests_message(requests: Sequence[Sequence[Any]]) -> list[Any]:
    """Several REQUEST messages (as `encode_request` and `with_budget` / `with_bundles` framed them: one header, one
    buffer) as one REQUESTS message: their headers, as they are, in one msgpack array, their buffers back to back in
    one frame. A client sends its direct requests of one event-loop turn so; the worker reads one message instead of
    several (`split_requests`: a receive, a decode and the inbox's steps a request less)."""
    if not 0 < len(requests) <= MAX_TOGETHER:
        raise ProtocolError("requests", f"a REQUESTS message holds 1..{MAX_TOGETHER} requests, got {len(requests)}")
    heads, buffers = [], []
    for frames in requests:
        first = bytes(_bytes(frames[0]))
        if len(frames) != 2 or first[:HEAD] != _HEADS[Cmd.REQUEST]:
            raise ProtocolError("requests", "each one is a REQUEST of one header and one buffer")
        heads.append(first[HEAD:])
        buffers.append(_bytes(frames[1]))
    n = len(heads)
    array = bytes((0x90 | n,)) if n < 16 else b"\xdc" + n.to_bytes(2, "big")
    return _framed(Cmd.REQUESTS, _REQUESTS_MAP + array + b"".join(heads), [b"".join(buffers)])


def split_requests(msg: Message) -> list[Message]:
    """A REQUESTS message as the REQUEST messages it holds, in order, each with a view of its part of the buffer.
    Each request's own fields are checked when it is parsed (`parse_request`: a bad one is refused alone); here only
    what splitting needs: the counts, and that they add up to the buffer (else the whole message is refused)."""
    if msg.cmd != Cmd.REQUESTS:
        raise ProtocolError("command", f"expected REQUESTS, got {msg.cmd.name}")
    heads = get(msg.header, "requests", list)
    if not 0 < len(heads) <= MAX_TOGETHER:
        raise ProtocolError("requests", f"a REQUESTS message holds 1..{MAX_TOGETHER} requests, got {len(heads)}")
    if len(msg.frames) != 1:
        raise ProtocolError("frames", f"a REQUESTS message carries one buffer, got {len(msg.frames)}")
    sizes = []
    for h in heads:
        if not isinstance(h, dict):
            raise ProtocolError("requests", f"each request's header is a map, got {type(h).__name__}")
        sizes.append(request_bytes(_count(h, "rows"), _count(h, "tokens"), _count(h, "markers")))
    buf = memoryview(_bytes(msg.frames[0]))
    if buf.nbytes != sum(sizes):
        raise ProtocolError(ARRAYS, f"the buffer holds {buf.nbytes} bytes; the requests' counts need {sum(sizes)}")
    out, at = [], 0
    for h, n in zip(heads, sizes):
        out.append(Message(Cmd.REQUEST, h, [buf[at:at + n]]))
        at += n
    return out


def rids_of_requests(msg: Message) -> list[Any]:
    """Best effort: the request ids of a REQUESTS message we refuse whole, so that each of its calls hears why."""
    heads = msg.header.get("requests")
    rids = [h.get("rid") for h in heads[:MAX_TOGETHER] if isinstance(h, dict)] if isinstance(heads, list) else []
    return [r for r in rids if isinstance(r, (int, str)) and not isinstance(r, bool)]


_PACKED_KEYS: dict[str, bytes] = {}     # `_with_field`'s keys, packed once (it runs for every attempt of every call)


def _with_field(frames: Sequence[Any], key: str, value: Any) -> list[Any]:
    """`frames` with `key: value` set in the header. Every attempt of every call sets one or two: a header that is a
    small map (a msgpack fixmap, as every header the client builds) gets the pair appended to its bytes, a
    microsecond instead of a decode and an encode. Were the key there already, the decoder keeps the last one."""
    first = bytes(_bytes(frames[0]))
    h = first[HEAD:]
    if h and 0x80 <= h[0] < 0x8f:
        packed = _PACKED_KEYS.get(key) or _PACKED_KEYS.setdefault(key, msgpack.packb(key))
        header = bytes((h[0] + 1,)) + h[1:] + packed + msgpack.packb(value)
    else:
        d = unpack(h, MAX_HEADER_BYTES)
        d[key] = value
        header = pack(d)
    return [first[:HEAD] + header, *frames[1:]]


def retry_after_of(error: dict | None) -> float | None:
    """A retryable reply's retry-after hint in seconds (`error.retry_after_ms`), or None."""
    ms = (error or {}).get("retry_after_ms")
    return ms / 1e3 if isinstance(ms, int) and not isinstance(ms, bool) and ms >= 0 else None


# ---------------------------------------------------------------------------------------------- replies

@dataclass
class Reply:
    rid: int | str | None
    status: str
    logits: np.ndarray | None = None    # float32 [M]
    act: np.ndarray | None = None       # float32 [R, n_act]
    error: dict[str, Any] | None = None  # {"field", "row", "message"} (final) or {"message"} (retryable)
    worker: str | None = None
    fingerprint: str | None = None
    metrics: dict[str, Any] = field(default_factory=dict)
    taps: dict[str, np.ndarray] | None = None
    header: dict[str, Any] = field(default_factory=dict)

    @property
    def message(self) -> str:
        return (self.error or {}).get("message", "")


class Replies:
    """The "ok" REPLYs of one forward's requests: what their headers share (status, worker, fingerprint, the
    group's metrics) is msgpack-packed once, and each reply packs only its own fields (rid, counts, its own
    metrics) and joins the bytes. A worker answers ~32 requests a forward at load, and packing the ~20 shared
    metrics for each was a tenth of its data thread (py-spy at 256 in flight on an H100 host). A forward's only
    request (`alone`) is packed whole instead: the shared part packed apart costs it more than it saves. Each header
    decodes to the map one `pack` of the whole makes (tests/test_wire.py)."""

    def __init__(self, *, worker: str | None = None, fingerprint: str | None = None, metrics: dict | None = None,
                 together: bool = False):
        """`together`: the worker takes REQUESTS messages on its direct socket, and says so in every ok reply (a
        client sends a route REQUESTS only once a reply on it said so: a worker older than them would refuse one)."""
        shared: dict[str, Any] = {"status": STATUS_OK}
        if worker is not None:
            shared["worker"] = worker
        if fingerprint is not None:
            shared["fp"] = fingerprint
        if together:
            shared[TOGETHER] = True
        self._head = shared
        self._metrics = _plain(metrics) if metrics else {}
        self._shared: bytes | None = None      # the shared part's bytes: made by the first `encode` or `bundle`

    def _pack_shared(self) -> None:
        self._shared, self._n_shared = pack(self._head)[1:], len(self._head)     # (a fixmap: one header byte)
        self._metric_pairs = _pairs(self._metrics)

    def alone(self, rid: Any, logits: np.ndarray, act: np.ndarray, metrics: dict | None = None,
              taps: dict[str, np.ndarray] | None = None) -> list[Any]:
        """`encode`'s reply, for the only one made of this group: one pack of the whole header (the metrics merged
        as `encode` merges them, each side made plain first)."""
        own, frames = _reply_fields(rid, logits, act, taps)
        header = {**own, **self._head}
        merged = {**self._metrics, **_plain(metrics)} if metrics else self._metrics
        if merged:
            header["metrics"] = merged if len(merged) <= MAX_METRIC_ITEMS else _plain(merged)
        return _framed(Cmd.REPLY, pack(header), frames)

    def encode(self, rid: Any, logits: np.ndarray, act: np.ndarray, metrics: dict | None = None,
               taps: dict[str, np.ndarray] | None = None) -> list[Any]:
        """One reply: logits float32 [M] and act float32 [R, n_act] as raw frames (+ taps, if any); `metrics`:
        this reply's own (where the group's metrics have the key too, this reply's value)."""
        if self._shared is None:
            self._pack_shared()
        own, frames = _reply_fields(rid, logits, act, taps)
        mine = _plain(metrics) if metrics else {}      # (keys as they go out: what the count and overlap are of)
        if not (self._metrics or mine):
            tail = b""
        elif (len(mine) < 16 and len(self._metrics) + len(mine) <= MAX_METRIC_ITEMS
              and self._metrics.keys().isdisjoint(mine)):
            tail = _METRICS_KEY + _map_head(len(self._metrics) + len(mine)) + self._metric_pairs + pack(mine)[1:]
        else:
            tail = _METRICS_KEY + pack(_plain({**self._metrics, **mine}))
        n = len(own) + self._n_shared + bool(tail)      # at most 9 keys: a fixmap
        return _framed(Cmd.REPLY, bytes((0x80 | n,)) + pack(own)[1:] + self._shared + tail, frames)

    def bundle(self, items: Sequence[tuple[Any, np.ndarray, np.ndarray, dict | None]]) -> list[Any]:
        """One BUNDLE: the replies `(rid, logits [M], act [R, n_act], own metrics)` of one client's requests, each
        the REPLY `encode` would make of it once `unbundle` splits them (tests/test_wire.py). A worker answering a
        client's 8 requests of a forward in one message spends 1.8 us a reply on it instead of 6 (encode and send,
        development CPU), and the client reads one message instead of 8. Logits and act travel back to back, one
        frame each; the header holds what the replies share and, per reply, [rid, markers, rows, own metrics]."""
        if not 0 < len(items) <= MAX_BUNDLE:
            raise ProtocolError("replies", f"a bundle holds 1..{MAX_BUNDLE} replies, got {len(items)}")
        if self._shared is None:
            self._pack_shared()
        logits, acts, entries = [], [], []
        for rid, lg, ac, own in items:
            lg, ac = np.ravel(lg), np.asarray(ac)
            if ac.ndim != 2:
                raise ProtocolError("act", f"must be [R, n_act], got shape {ac.shape}")
            logits.append(lg)
            acts.append(ac)
            entries.append([rid, lg.shape[0], ac.shape[0], _plain(own) if own else {}])
        try:
            act = np.concatenate(acts)
        except ValueError as e:
            raise ProtocolError("act", "every reply of a bundle has the same n_act") from e
        tail = (b"" if not self._metrics else _METRICS_KEY + _map_head(len(self._metrics)) + self._metric_pairs)
        n = self._n_shared + 2 + bool(tail)
        header = (bytes((0x80 | n,)) + self._shared + tail + _N_ACT_KEY + pack(act.shape[1]) + _REPLIES_KEY
                  + pack(entries))
        return _framed(Cmd.BUNDLE, header, [np.concatenate(logits).astype(F32, copy=False).data,
                                            act.astype(F32, copy=False).reshape(-1).data])


def _reply_fields(rid: Any, logits: np.ndarray, act: np.ndarray,
                  taps: dict[str, np.ndarray] | None) -> tuple[dict[str, Any], list[Any]]:
    """A reply's own header fields (rid, counts, its taps' specs) and its frames: logits, act, the taps."""
    lg, ac = logits, act
    # What the runtime answers (contiguous float32 of these shapes) goes as it is; anything else is converted.
    if not _as_is(lg, F32, 1):
        lg = np.ascontiguousarray(np.asarray(logits, np.float32).reshape(-1), dtype=F32)
    if not _as_is(ac, F32, 2):
        ac = np.asarray(act, np.float32)
        if ac.ndim != 2:
            raise ProtocolError("act", f"must be [R, n_act], got shape {ac.shape}")
        ac = np.ascontiguousarray(ac, dtype=F32)
    own: dict[str, Any] = {"rid": rid, "markers": lg.shape[0], "rows": ac.shape[0], "n_act": ac.shape[1]}
    frames = [lg.data, ac.data]
    if taps:
        specs = []
        for name, t in taps.items():
            a = np.ascontiguousarray(np.asarray(t, np.float32), dtype=F32)
            specs.append([str(name), [int(x) for x in a.shape]])
            frames.append(a.data)
        own["taps"] = specs
    return own, frames


def unbundle(msg: Message) -> list[Message]:
    """A BUNDLE as the REPLY messages it holds, in its order: each one's header is the REPLY's (rid, counts, status,
    worker, fingerprint, the shared metrics with its own), its frames views of the bundle's. Every count is checked
    against the frames before any is made (a bundle that does not add up is refused whole, naming the part)."""
    if msg.cmd != Cmd.BUNDLE:
        raise ProtocolError("command", f"expected BUNDLE, got {msg.cmd.name}")
    h = msg.header
    if get(h, "status", str) != STATUS_OK:
        raise ProtocolError("status", "a bundle carries ok replies only")
    n_act = _count(h, "n_act")
    entries = get(h, "replies", list)
    if not 0 < len(entries) <= MAX_BUNDLE:
        raise ProtocolError("replies", f"a bundle holds 1..{MAX_BUNDLE} replies, got {len(entries)}")
    if len(msg.frames) != 2:
        raise ProtocolError("frames", f"a bundle carries logits and act (2 buffers), got {len(msg.frames)}")
    shared = {k: v for k, v in h.items() if k not in ("replies", "n_act", "metrics")}
    metrics = get(h, "metrics", dict, default={})
    counts = []
    for e in entries:
        if (not isinstance(e, list) or len(e) != 4 or not isinstance(e[3], dict)
                or type(e[1]) is not int or type(e[2]) is not int or not 0 <= e[1] <= MAX_COUNT
                or not 0 <= e[2] <= MAX_COUNT):
            raise ProtocolError("replies", f"each reply of a bundle is [rid, markers, rows, metrics], got {e!r:.80}")
        counts.append((e[1], e[2]))
    logits = _array(msg.frames[0], F32, sum(m for m, _ in counts), "logits")
    act = _array(msg.frames[1], F32, sum(r for _, r in counts) * n_act, "act")
    out = []
    m0 = r0 = 0
    for (rid, m, r, own), _ in zip(entries, counts):
        header = {**shared, "rid": rid, "markers": m, "rows": r, "n_act": n_act, "metrics": {**metrics, **own}}
        out.append(Message(Cmd.REPLY, header, [logits[m0:m0 + m].data, act[r0 * n_act:(r0 + r) * n_act].data]))
        m0, r0 = m0 + m, r0 + r
    return out


_METRICS_KEY = msgpack.packb("metrics")
_N_ACT_KEY = msgpack.packb("n_act")
_REPLIES_KEY = msgpack.packb("replies")


def _map_head(n: int) -> bytes:
    """msgpack's header of a map of `n` pairs (fixmap, map16 or map32)."""
    if n < 16:
        return bytes((0x80 | n,))
    if n < 1 << 16:
        return b"\xde" + n.to_bytes(2, "big")
    return b"\xdf" + n.to_bytes(4, "big")


def _pairs(d: dict[str, Any]) -> bytes:
    """The key-value pairs of a msgpack map, without its header: maps are joined from these."""
    return pack(d)[len(_map_head(len(d))):]


def encode_reply(rid: Any, logits: np.ndarray, act: np.ndarray, *, worker: str | None = None,
                 fingerprint: str | None = None, metrics: dict | None = None,
                 taps: dict[str, np.ndarray] | None = None) -> list[Any]:
    """An "ok" REPLY: logits float32 [M] and act float32 [R, n_act] as raw frames (+ taps, if any)."""
    return Replies(worker=worker, fingerprint=fingerprint).alone(rid, logits, act, metrics, taps=taps)


def encode_error(rid: Any, status: str, message: str, *, field: str | None = None, row: int | None = None,
                 worker: str | None = None, cmd: Cmd = Cmd.REPLY, reason: str | None = None,
                 retry_after: float | None = None) -> list[Any]:
    """A "final" (bad request: names field and row) or "retryable" (busy, worker lost ...) reply; `retry_after`
    (seconds): when the client should try again (a busy pool's hint)."""
    if status not in (STATUS_RETRYABLE, STATUS_FINAL):
        raise ValueError(f"an error reply is retryable or final, not {status!r}")
    err: dict[str, Any] = {"message": str(message)[:MAX_STR]}
    if field is not None:
        err["field"] = str(field)[:256]
    if row is not None:
        err["row"] = int(row)
    if reason is not None:
        err["reason"] = str(reason)     # a contract.Reason travels as its text
    if retry_after is not None:
        err["retry_after_ms"] = max(0, round(retry_after * 1e3))
    h: dict[str, Any] = {"rid": rid, "status": status, "error": err}
    if worker is not None:
        h["worker"] = worker
    return encode(cmd, h)


def _plain_ok_reply(h: dict) -> tuple | None:
    """An ok reply's fields (rid, worker, fp, metrics, markers, rows, n_act) when it has no taps and each field is of
    exactly its type and within its bounds (every such reply a worker of ours sends), read without a `get` a field.
    None for anything else, which `parse_reply`'s checks then refuse with the field's name or accept as this would
    have (tests/test_wire.py holds the two to each other)."""
    g = h.get
    if g("status") != STATUS_OK or "taps" in h:
        return None
    rid, worker, fp, metrics, m, r, n_act = g("rid"), g("worker"), g("fp"), g("metrics"), g("markers"), g("rows"), \
        g("n_act")
    if not ((rid is None or _plain_id(rid)) and _plain_counts(m, r, n_act) and _plain_str(worker) and _plain_str(fp)):
        return None
    if metrics is not None and type(metrics) is not dict:
        return None
    return rid, worker, fp, metrics or {}, m, r, n_act


def parse_reply(msg: Message, arrays: bool = True) -> Reply:
    """Check a REPLY: status, error shape, and that every buffer matches the header's counts. Without `arrays`
    (the broker, which forwards the buffers untouched) the sizes are checked but no array is built."""
    if msg.cmd != Cmd.REPLY:
        raise ProtocolError("command", f"expected REPLY, got {msg.cmd.name}")
    h = msg.header
    plain = _plain_ok_reply(h)
    if plain is not None:
        rid, worker, fp, metrics, m, r, n_act = plain
        status, specs = STATUS_OK, []
    else:
        rid = h.get("rid")
        if rid is not None:
            rid = _rid(h)
        status = get(h, "status", str)
        if status not in STATUSES:
            raise ProtocolError("status", f"must be one of {STATUSES}, got {status!r}")
        worker = get(h, "worker", str, default=None)
        fp = get(h, "fp", str, default=None)
        metrics = get(h, "metrics", dict, default=None) or {}
        if status != STATUS_OK:
            err = get(h, "error", dict)
            get(err, "message", str, what="error")
            if msg.frames:
                raise ProtocolError("frames", f"an error reply carries no buffers, got {len(msg.frames)}")
            return Reply(rid, status, error=err, worker=worker, fingerprint=fp, metrics=metrics, header=h)
        m, r, n_act = _count(h, "markers"), _count(h, "rows"), _count(h, "n_act")
        specs = get(h, "taps", list, default=[])
    if len(specs) > MAX_TAPS:
        raise ProtocolError("taps", f"{len(specs)} taps exceed the limit of {MAX_TAPS}")
    if len(msg.frames) != 2 + len(specs):
        raise ProtocolError("frames", f"an ok reply carries logits, act and {len(specs)} taps "
                                      f"({2 + len(specs)} buffers), got {len(msg.frames)}")
    if arrays:
        logits = _array(msg.frames[0], F32, m, "logits")
        act = _array(msg.frames[1], F32, r * n_act, "act").reshape(r, n_act)
    else:
        logits = act = None
        _check_size(msg.frames[0], F32, m, "logits")
        _check_size(msg.frames[1], F32, r * n_act, "act")
    taps = None
    if specs:
        taps = {}
        for spec, frame in zip(specs, msg.frames[2:]):
            if (not isinstance(spec, list) or len(spec) != 2 or not isinstance(spec[0], str)
                    or not isinstance(spec[1], list) or not all(isinstance(s, int) and s >= 0 for s in spec[1])):
                raise ProtocolError("taps", f"each tap is [name, shape], got {spec!r}")
            n = int(np.prod(spec[1], dtype=np.int64)) if spec[1] else 1
            if n > MAX_COUNT * 64:
                raise ProtocolError("taps", f"tap {spec[0]!r} is too large")
            taps[spec[0]] = _array(frame, F32, n, f"taps[{spec[0]}]").reshape(spec[1])
    return Reply(rid, status, logits=logits, act=act, worker=worker, fingerprint=fp, metrics=metrics,
                 taps=taps, header=h)


def parse_any_reply(msg: Message) -> Reply:
    """A reply of any command (REPLY, STATUS, DESCRIBE, DRAIN, HEARTBEAT): status + error + body."""
    if msg.cmd == Cmd.REPLY:
        return parse_reply(msg)
    h = msg.header
    rid = h.get("rid")
    if rid is not None:
        rid = _rid(h)
    status = get(h, "status", str, default=STATUS_OK)
    if status not in STATUSES:
        raise ProtocolError("status", f"must be one of {STATUSES}, got {status!r}")
    err = get(h, "error", dict, default=None)
    if status != STATUS_OK and err is None:
        raise ProtocolError("error", f"a {status} reply must say why")
    return Reply(rid, status, error=err, worker=get(h, "worker", str, default=None), header=h)


# ---------------------------------------------------------------------------------------------- bodies

def encode_body_reply(cmd: Cmd, rid: Any, body: Any, **header: Any) -> list[Any]:
    """An "ok" reply to STATUS / DESCRIBE / DRAIN: the body travels msgpack-encoded in its own frame."""
    data = pack(body)
    if len(data) > MAX_BODY_BYTES:
        raise ProtocolError("body", f"{len(data)} bytes exceed the limit of {MAX_BODY_BYTES}")
    return encode(cmd, {"rid": rid, "status": STATUS_OK, **header}, data)


def body_of(msg: Message, limit: int = MAX_BODY_BYTES) -> Any:
    if len(msg.frames) != 1:
        raise ProtocolError("frames", f"a {msg.cmd.name} reply carries one body frame, got {len(msg.frames)}")
    return unpack(msg.frames[0], limit, "body")


_SCALARS = frozenset((bool, int, float, str, type(None)))


def _plain(obj: Any, depth: int = 0) -> Any:
    """Metrics as msgpack-safe plain values (numpy scalars become Python numbers). Plain scalars are taken as
    they are without a call each: every reply's metrics pass through here (~25 values, mostly numbers)."""
    if depth > 8:
        return None
    if isinstance(obj, dict):
        return {(k if type(k) is str else str(k)): (v if type(v) in _SCALARS else _plain(v, depth + 1))
                for k, v in itertools.islice(obj.items(), MAX_METRIC_ITEMS)}
    if isinstance(obj, (list, tuple)):
        return [v if type(v) in _SCALARS else _plain(v, depth + 1) for v in obj[:MAX_METRIC_ITEMS]]
    if isinstance(obj, (bool, int, float, str)) or obj is None:
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    return str(obj)


plain = _plain


# ---------------------------------------------------------------------------------------------- endpoints

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def is_loopback(endpoint: str) -> bool:
    """True for ipc://, inproc:// and tcp:// on a loopback address (127.0.0.0/8, ::1, localhost)."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return True
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint_host(endpoint)     # "tcp://src;dst": judge the destination / bind address
    if host in LOOPBACK_HOSTS:
        return True
    try:              # an address, not a name that merely starts like one ("127.evil.example")
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def endpoint_host(endpoint: str) -> str:
    """The address of a "tcp://HOST:PORT" endpoint ("tcp://src;dst:port": the destination's)."""
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0]
    return host.split(";", 1)[1] if ";" in host else host


def load_curve_keys(keys: str | os.PathLike, role: str = "client") -> tuple[bytes, bytes, bytes]:
    """(public, secret, server public) for `role` ("client", "worker", "operator") from a `laya-pool keys` directory.

    Raises FileNotFoundError for a missing file and ValueError for one that is not a key, so a process
    can check its keys before it does anything expensive (a worker does, before loading the model)."""
    import zmq.auth

    if role not in ("client", "worker", "operator", "server"):
        raise ValueError(f"role must be 'client', 'worker', 'operator' or 'server', got {role!r}")
    keys = Path(keys)
    for name in (f"{role}.key_secret", "server.key"):
        if not (keys / name).is_file():
            raise FileNotFoundError(f"{keys / name}: missing (generate keys with `laya-pool keys --out DIR`)")
    public, secret = zmq.auth.load_certificate(str(keys / f"{role}.key_secret"))
    server_public, _ = zmq.auth.load_certificate(str(keys / "server.key"))
    if not public or not secret or not server_public:
        raise ValueError(f"{keys}: the {role} key pair or the server key is incomplete")
    return public, secret, server_public


def configure_curve_client(sock: Any, keys: str | os.PathLike, role: str = "client",
                           server_key: bytes | None = None) -> None:
    """Make a zmq socket a CURVE client (role "client" or "worker") with keys from `laya-pool keys --out DIR`;
    `server_key` (z85): the peer is not the broker but a worker's direct socket, whose key the broker's table gave.

    Here, in the one module every process imports, so clients and workers authenticate the same way.
    """
    public, secret, server_public = load_curve_keys(keys, role)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_key or server_public


def configure_curve_server(sock: Any, keys: str | os.PathLike, role: str, domain: str) -> bytes:
    """Make a zmq socket a CURVE server with `role`'s key pair ("server": the broker's; "worker": a worker's direct
    socket), its peers judged by the authenticator's `domain` (`start_authenticator`); the public key (z85)."""
    import zmq

    public, secret, _ = load_curve_keys(keys, role)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True
    sock.zap_domain = domain.encode()
    # Without a ZAP handler in its context (not started yet, stopped, died) ZeroMQ would admit every key: refuse all.
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return public


def start_authenticator(ctx: Any, folders: dict[str, Path]) -> Any:
    """A ZAP handler (a thread of `ctx`) admitting, for each domain, the public keys in its folder; stop() it."""
    from zmq.auth.thread import ThreadAuthenticator

    for folder in folders.values():
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: missing (the public keys this socket admits; `laya-pool keys`)")
    auth = ThreadAuthenticator(ctx)
    auth.start()
    for domain, folder in folders.items():
        auth.configure_curve(domain=domain, location=str(folder))
    return auth


def stop_authenticator(auth: Any) -> None:
    """Stop `start_authenticator`'s handler, also one whose thread died (pyzmq's stop would wait forever telling it)."""
    if not auth.is_alive() and auth.pipe is not None:
        auth.pipe.close(linger=0)
        auth.pipe, auth.thread = None, None
    auth.stop()


def worker_identity(wid: str) -> str:
    """A worker socket's identity: its id, '@', and 8 hex digits of its own (so no two sockets ever share one, and a
    READY for a live worker's id from another socket is told apart: broker/workers.py `on_ready`)."""
    return f"{wid}@{secrets.token_hex(4)}"


def identity_of(wid: str, identity: bytes) -> bool:
    """Whether `identity` is a socket of worker `wid`: the id itself (workers before per-socket identities), or
    `worker_identity(wid)`'s form."""
    head, at, tail = identity.partition(b"@")
    return head == wid.encode() and (not at or (len(tail) == 8 and all(c in b"0123456789abcdef" for c in tail)))


def is_unspecified(endpoint: str) -> bool:
    """A tcp endpoint on a wildcard address (`tcp://*:*`, 0.0.0.0, ::): where one binds, not where one connects."""
    return endpoint.startswith("tcp://") and endpoint_host(endpoint) in ("*", "0.0.0.0", "::", "[::]")


def is_curve_key(text: Any) -> bool:
    """A z85 CURVE public key as a table carries it (40 characters of ZeroMQ's z85 alphabet)."""
    return isinstance(text, str) and len(text) == 40 and all(c in _Z85 for c in text)


_Z85 = frozenset("0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#")
