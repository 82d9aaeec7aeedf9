"""Lanes: a request from a client to a worker on the same host, and its reply, through shared memory.

Why: every ZeroMQ hop wakes two I/O threads. On an H200 host a round trip between two processes takes 88-92 us
through a ZeroMQ ROUTER/DEALER pair and 7.9 us through a lane with both ends polling (23 us with the client asleep on
the lane's futex; `python -m benchmarks.lane_rtt`); with lanes the pool added 0.35 ms to a 1x48 forward there instead
of 0.64 (docs/decisions/0014-clients-straight-to-the-workers.md). A lane takes the sockets off the way of a request
whose client and worker are both awake to see it.

A lane is one file in /dev/shm that the client creates (mode 0600, a random name, its blocks allocated so that a full
/dev/shm is an error now and not a SIGBUS later) with a random secret in its header, and names to the worker over its
direct socket (`Cmd.LANE`, with the secret: a process that cannot read the file cannot name it as its own); the
worker checks it, maps it and unlinks the name, so nothing is left behind whichever process dies. It holds a header
of int64 words, then the request area, then the reply area. One request at a time: the client writes the request's
frames, then their length, then a new request number; the worker, which reads the number first, answers into the
reply area the same way. The worker polls its lanes while it is awake (and says so in each lane's header, AWAKE); the
client polls its lane while it waits, or sleeps on the lane's bell (a futex: a counter the worker raises and wakes
after every answer and when it closes the lane: one thread woken, where an answer on a socket woke three), or,
waiting on several things at once, sleeps on its sockets and asks to be rung there (RING). A worker that closes a
lane (making room, leaving) says so (GONE): the client then counts what was on it as lost, as with a dropped
connection. What a lane cannot carry (too large) goes over the sockets as before.

The order of the writes is what makes a message whole for the reader: x86-64 keeps a core's stores in order and its
loads in order, so lanes are offered on x86-64 Linux only, where the futex call works (`supported`). AWAKE is not
exact: a store may wait in its core's buffer past a later load, so a client can see AWAKE an instant after the
worker cleared it; the worker's one nap after it falls asleep (2 ms) and the client's ring (after writing, it finds
the worker asleep) bound what that costs. A sleeping client also wakes every 2 ms to look at its sockets. What a lane
carries is decoded with the wire protocol's bounds like any message.
"""
from __future__ import annotations

import ctypes
import errno
import hmac
import mmap
import os
import platform
import re
import secrets
import stat
import struct
import sys
import time
from collections.abc import Sequence
from typing import Any

from .wire import ProtocolError, _bytes, _nbytes

# The header's int64 words, then the secret's bytes.
REQ_SEQ, REQ_LEN, REP_SEQ, REP_LEN, AWAKE, RING, CLOSED, MAGIC_WORD, GONE, BELL = range(10)
SECRET_AT, SECRET_BYTES = 96, 16
HEADER_BYTES = 128
AREA_BYTES = 64 * 1024              # a 1x48 request is ~1 KB, its reply ~0.3 KB; larger ones take the sockets
SIZE = HEADER_BYTES + 2 * AREA_BYTES
MAGIC = 0x344E414C4159414C          # b"LAYALAN4", little-endian
BY_SOCKET = -1                      # REP_LEN of a reply that went over the socket (the lane is free again)
MAX_FRAMES = 16
NAP_MS = 2                          # each side's nap that bounds what an inexact flag costs (module docstring)
DIRECTORY = "/dev/shm"
_NAME = re.compile(r"laya-lane-[0-9a-f]{16}")
_U32 = struct.Struct("<I")


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_SYS_FUTEX, _FUTEX_WAIT, _FUTEX_WAKE = 202, 0, 1     # x86-64; not the private flavour: two processes share the word
_futex = None


def _bind_futex() -> bool:
    """The futex system call through libc (ctypes lets go of the GIL while it sleeps), checked once: False where it
    is missing or refused (a sandbox)."""
    global _futex
    if _futex is None:
        _futex = False
        try:
            if ctypes.sizeof(ctypes.c_void_p) == 8:       # a 32-bit Python numbers its system calls otherwise
                f = ctypes.CDLL(None, use_errno=True).syscall
                f.restype = ctypes.c_long
                f.argtypes = (ctypes.c_long, ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_void_p,
                              ctypes.c_void_p, ctypes.c_int)
                word = ctypes.c_int32(0)
                woke = f(_SYS_FUTEX, ctypes.addressof(word), _FUTEX_WAKE, 1, None, None, 0)
                # a wait for a value the word does not hold must refuse at once: EAGAIN
                wait = f(_SYS_FUTEX, ctypes.addressof(word), _FUTEX_WAIT, 1, None, None, 0)
                if woke == 0 and wait == -1 and ctypes.get_errno() == errno.EAGAIN:
                    _futex = f
        except (OSError, AttributeError):
            pass
    return bool(_futex)


def supported() -> bool:
    """Whether this host can have lanes (see the module docstring)."""
    return (sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
            and os.path.isdir(DIRECTORY) and os.access(DIRECTORY, os.W_OK) and _bind_futex())


def valid_name(name: Any) -> bool:
    """A name `Lane.create` could have made (nothing else in /dev/shm is opened)."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


def sweep(older_than_s: float = 60.0) -> int:
    """Remove this user's lane files older than `older_than_s`: a worker unlinks a lane's name as it opens it, so a
    name that old belongs to a client that died before any worker took its lane. How many went."""
    gone = 0
    now = time.time()
    for name in os.listdir(DIRECTORY):
        if not valid_name(name):
            continue
        path = os.path.join(DIRECTORY, name)
        try:
            st = os.stat(path, follow_symlinks=False)
            if st.st_uid == os.getuid() and stat.S_ISREG(st.st_mode) and now - st.st_mtime > older_than_s:
                os.unlink(path)
                gone += 1
        except OSError:
            continue              # another sweeper, or its client, took it first
    return gone


def lane_rid(name: str) -> str:
    """The request id of a lane's own messages (LANE: open it, or a ring either way; back: opened or refused), the
    lane's name: apart from every request's id (a client's are integers)."""
    return f"lane:{name[:40]}"


def lane_of(rid: Any) -> str | None:
    """The lane's name in a `lane_rid`, else None."""
    return rid[5:] if isinstance(rid, str) and rid.startswith("lane:") else None


def pack_frames(frames: Sequence[Any], area: memoryview) -> int | None:
    """Write `frames` into `area`: their count and lengths (u32 each), then their bytes back to back. Their size, or
    None: no room."""
    count = len(frames)
    if not 1 <= count <= MAX_FRAMES:
        return None
    # bytes as they are (what the client's frames mostly are: 0.6 us a message less than going through `_bytes`)
    blob = b"".join(frames if all(type(f) is bytes for f in frames) else [_bytes(f) for f in frames])
    lengths = [len(f) if type(f) is bytes else _nbytes(f) for f in frames]
    head = struct.pack(f"<{count + 1}I", count, *lengths)
    size = len(head) + len(blob)
    if size > len(area):
        return None
    area[: len(head)] = head
    area[len(head): size] = blob
    return size


def unpack_frames(area: memoryview, size: int) -> list[bytes]:
    """The frames `pack_frames` wrote (copies: the area is written again by the next message); a ProtocolError
    names what is wrong with anything else."""
    if not 4 <= size <= len(area):
        raise ProtocolError("lane", f"a message of {size} bytes in an area of {len(area)}")
    count = _U32.unpack_from(area, 0)[0]
    if not 1 <= count <= MAX_FRAMES:
        raise ProtocolError("lane", f"{count} frames (1..{MAX_FRAMES})")
    at = 4 * (count + 1)
    if at > size:
        raise ProtocolError("lane", "the frames' lengths run past the message's size")
    lengths = struct.unpack_from(f"<{count}I", area, 4)
    if at + sum(lengths) != size:
        raise ProtocolError("lane", f"frames of {sum(lengths)} bytes in a message of {size - at} after its lengths")
    blob = bytes(area[at: size])
    frames, pos = [], 0
    for n in lengths:
        frames.append(blob[pos: pos + n])
        pos += n
    return frames


class Lane:
    """One lane, mapped. The client `create`s it and calls `ask` / `answer`; the worker `open`s it and calls `asked`
    / `reply`, and `leave`s it. Either may `close` its mapping; the other's stays valid."""

    def __init__(self, name: str, fd: int):
        self.name = name
        try:
            self._map = mmap.mmap(fd, SIZE)
        finally:
            os.close(fd)
        view = memoryview(self._map)
        self.words = view[:HEADER_BYTES].cast("q")     # int64 words; reading one gives a Python int at once
        self.request = view[HEADER_BYTES: HEADER_BYTES + AREA_BYTES]
        self.reply_area = view[HEADER_BYTES + AREA_BYTES: SIZE]
        self._view = view
        # The low half of BELL, where a client sleeps for its answer (`sleep`) and the worker wakes it (`_ring`).
        self._bell = ctypes.c_int32.from_buffer(self._map, BELL * 8)
        self._bell_addr = ctypes.addressof(self._bell)
        self._open = True
        self.seen = 0               # the worker: the last request number it took
        self.identity: bytes | None = None    # the worker: the client's identity on its direct socket
        self.used = 0.0             # the worker: when it last carried a request (monotonic; worker/lanes.py)

    # -- the client ------------------------------------------------------------------------------------------
    @classmethod
    def create(cls) -> Lane:
        """A new lane (OSError: /dev/shm cannot hold it)."""
        name = f"laya-lane-{secrets.token_hex(8)}"
        path = os.path.join(DIRECTORY, name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.posix_fallocate(fd, 0, SIZE)     # ENOSPC here, not a SIGBUS at the first write into a full tmpfs
        except OSError:
            os.close(fd)
            os.unlink(path)
            raise
        lane = cls(name, fd)
        lane.words[MAGIC_WORD] = MAGIC
        lane._view[SECRET_AT: SECRET_AT + SECRET_BYTES] = secrets.token_bytes(SECRET_BYTES)
        return lane

    def secret(self) -> str:
        """What the worker must be told with the name (hex)."""
        return bytes(self._view[SECRET_AT: SECRET_AT + SECRET_BYTES]).hex()

    def unlink(self) -> None:
        """The name goes (the mappings stay)."""
        try:
            os.unlink(os.path.join(DIRECTORY, self.name))
        except FileNotFoundError:
            pass

    def free(self) -> bool:
        """No request of ours is waiting for its answer here."""
        return self.words[REP_SEQ] == self.words[REQ_SEQ]

    def usable(self) -> bool:
        """Free, and the worker polls its lanes now (see the module docstring for what "now" means)."""
        return self.free() and self.worker_awake() and not self.gone()

    def worker_awake(self) -> bool:
        return self.words[AWAKE] == 1

    def gone(self) -> bool:
        """The worker closed the lane: nothing on it will be answered here."""
        return bool(self.words[GONE])

    def ask(self, frames: Sequence[Any]) -> int | None:
        """Write a request; its number, or None: it does not fit (send it over the socket)."""
        size = pack_frames(frames, self.request)
        if size is None:
            return None
        seq = self.words[REQ_SEQ] + 1
        self.words[REQ_LEN] = size
        self.words[REQ_SEQ] = seq          # last: the worker reads this first
        return seq

    def answer(self) -> list[bytes] | None:
        """The reply to our request once it is here ([] when it went over the socket), else None."""
        seq = self.words[REP_SEQ]
        if seq != self.words[REQ_SEQ] or seq == 0:
            return None
        size = self.words[REP_LEN]
        return [] if size == BY_SOCKET else unpack_frames(self.reply_area, size)

    def sleep(self, timeout_s: float) -> bool:
        """Sleep until the worker answers (or closes the lane), `timeout_s` at most, without the GIL. False: this
        process cannot (sleep some other way)."""
        bell = self.words[BELL]             # first: a ring after this read changes the word the wait checks
        if self.words[REP_SEQ] == self.words[REQ_SEQ] or self.words[GONE]:
            return True
        if not _bind_futex():
            return False
        ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
        expected = ctypes.c_int32(bell & 0xFFFFFFFF).value
        if _futex(_SYS_FUTEX, self._bell_addr, _FUTEX_WAIT, expected, ctypes.byref(ts), None, 0) < 0:
            return ctypes.get_errno() in (errno.EAGAIN, errno.ETIMEDOUT, errno.EINTR)
        return True

    def ring_me(self, on: bool) -> None:
        """Whether the worker should also ring us on the socket after answering (we sleep on our sockets)."""
        self.words[RING] = int(on)

    # -- the worker ------------------------------------------------------------------------------------------
    @classmethod
    def open(cls, name: Any, secret: Any) -> Lane:
        """A client's lane, checked: our name pattern, a regular file of ours that nobody else may read, its size, its
        blocks, its magic number and the client's secret; then its name is unlinked. A ProtocolError (field "lane")
        says which check failed."""
        if not valid_name(name):
            raise ProtocolError("lane", f"not a lane's name: {str(name)[:40]!r}")
        try:
            fd = os.open(os.path.join(DIRECTORY, name), os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as e:
            raise ProtocolError("lane", f"cannot open {name}: {e.strerror}") from e
        st = os.fstat(fd)
        why = None
        if not stat.S_ISREG(st.st_mode):
            why = "not a regular file"
        elif st.st_uid != os.getuid():
            why = "it belongs to another user"
        elif st.st_mode & 0o077:
            why = f"others may read or write it (mode {st.st_mode & 0o777:o})"
        elif st.st_size != SIZE:
            why = f"its size is {st.st_size}, not {SIZE}"
        elif st.st_blocks * 512 < SIZE:
            why = "its memory is not allocated"
        if why is not None:
            os.close(fd)
            raise ProtocolError("lane", f"{name}: {why}")
        lane = cls(name, fd)
        if lane.words[MAGIC_WORD] != MAGIC:
            why = "not a lane (magic number)"
        elif not (isinstance(secret, str) and secret.isascii() and hmac.compare_digest(secret, lane.secret())):
            why = "the secret does not match"
        if why is not None:
            lane.close()
            raise ProtocolError("lane", f"{name}: {why}")
        lane.unlink()
        lane.seen = lane.words[REQ_SEQ]
        return lane

    def has_request(self) -> bool:
        """A request the worker has not taken yet."""
        return self.words[REQ_SEQ] != self.seen

    def asked(self) -> list[bytes] | None:
        """A new request's frames, else None. Its number is taken either way: a malformed request raises once."""
        if not self.has_request():
            return None
        self.seen = self.words[REQ_SEQ]
        return unpack_frames(self.request, self.words[REQ_LEN])

    def reply(self, frames: Sequence[Any] | None) -> bool:
        """Answer the request taken last: its frames, or None when they went over the socket. False: they do not fit
        (send them over the socket, then call `reply(None)`)."""
        if frames is None:
            size = BY_SOCKET
        else:
            size = pack_frames(frames, self.reply_area)
            if size is None:
                return False
        self.words[REP_LEN] = size
        self.words[REP_SEQ] = self.seen      # last: the client reads this first
        self._ring()
        return True

    def empty(self) -> bool:
        """Nothing on the lane: no request waiting to be taken, none taken and not answered."""
        return not self.has_request() and self.words[REP_SEQ] == self.seen

    def wants_ring(self) -> bool:
        """The client sleeps on its sockets: ring it there too (the inbox does)."""
        return bool(self.words[RING])

    def _ring(self) -> None:
        """Raise the bell and wake a client asleep on it (`sleep`): a system call of ~1 us when none is."""
        self.words[BELL] = self.words[BELL] + 1
        if _bind_futex():
            _futex(_SYS_FUTEX, self._bell_addr, _FUTEX_WAKE, 1, None, None, 0)

    def closed(self) -> bool:
        """The client closed the lane (or this end's mapping is gone)."""
        return not self._open or bool(self.words[CLOSED])

    def mapped(self) -> bool:
        return self._open

    def set_awake(self, on: bool) -> None:
        """Whether we poll the lanes now (a client sends on a lane only then)."""
        self.words[AWAKE] = int(on)

    def leave(self) -> None:
        """Close the lane from the worker's side, saying so first (the client counts what is on it as lost)."""
        if self.mapped():
            self.words[AWAKE] = 0
            self.words[GONE] = 1
            self._ring()
        self.close()

    # -- both --------------------------------------------------------------------------------------------------
    def close(self, *, say: bool = False) -> None:
        """Drop this end's mapping; `say`: tell the other end first (the client, leaving). A mapping still exported
        elsewhere (a view someone kept) stays until it is collected."""
        if not self._open:
            return
        if say:
            self.words[CLOSED] = 1
        self._open = False
        del self._bell                # its hold on the mapping
        for v in (self.words, self.request, self.reply_area, self._view):
            v.release()
        try:
            self._map.close()
        except BufferError:
            pass
