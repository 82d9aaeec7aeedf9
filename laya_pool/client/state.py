"""The state's token ids, tokenizing only the part of a long state that any row can keep.

The SDK tokenizes the whole state and every row keeps at most `room` tokens of it: the first `room`
(a text or JSON state) or the last `room` (a conversation list). A 2,048-token state costs ~2 ms of
tokenizing for ~480 tokens any row keeps. `tokenize_state` tokenizes a window of the text that is
just large enough, cut at a *safe cut*, and counts the whole state (the `usage` the SDK reports) in a
background thread while the request is in flight.

Why a safe cut gives exactly the SDK's tokens (the tokenizer's stages, in order):

- added tokens ("[CLS]", ...) are matched first and split the text into segments; a cut with no
  added-token text within `margin` characters of it cannot change which are matched, nor what their
  lstrip / rstrip / single_word rules absorb (whitespace they absorb lies wholly on one side);
- no normalizer (required below), so nothing rewrites text across the cut;
- the ByteLevel pre-tokenizer splits each segment with the GPT-2 pattern
  `'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`. No alternative
  matches a non-space character followed by a space character (spaces only lead a match or fill it),
  so a position `p` with `text[p-1]` non-space and `text[p]` space is a piece boundary however the scan
  started, the pieces after `p` depend only on `text[p:]` (no look-behind), and the pieces before `p`
  are found identically in `text[:p]` (the only look-ahead, `(?!\\S)`, ends a run of spaces, and none
  ends at `p`);
- BPE merges within a piece, never across pieces.

So `tokens(text) == tokens(text[:p]) + tokens(text[p:])` at every safe cut: both windows are exact.
The cut characters are kept to ones every definition of space agrees on (" " and "\\n" after a letter,
digit or printable ASCII), and the whole argument is only used for tokenizers whose configuration it
covers (`window_safe`); any other tokenizer tokenizes the whole state. The background count of the whole
state (in pieces cut at safe cuts, by the same lemma: the client never holds the whole state's tokens) also
re-checks the window against its first piece, which runs past the window's cut (`StateTokens.window_agrees`),
so a violated assumption is caught rather than answered (the client then re-sends rows built from the whole
state).
"""
from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

_CUT_CHARS = (" ", "\n")
_MIN_WINDOW_CHARS = 2048        # shorter states are tokenized whole: the window would not save anything
_MAX_PROBES = 256               # candidate cuts looked at before giving up (a text of spaced-out emoji)
_GROW = 1.05                    # a window sized for 5% more tokens than asked: one pass nearly always
# A window piece is tokenized in parts of at least this many characters, cut at safe cuts and given to the tokenizer
# as one batch, which it spreads over its threads (`in_parts`). Below ~2,000 characters two parts cost what one does
# (2-core CPU: a 16x512 request's 3,900-character window 0.48 -> 0.30 ms in 2-4 parts; 1,500 characters no gain). On a
# 16-core H100 host a 16x512 request's whole encode went 0.77 -> 0.46 ms.
_PART_CHARS = 1024
# The whole state's count goes in pieces of this many characters, each piece's tokens dropped once counted: what a
# piece costs (~200 bytes a token while tokenized) is bounded, whatever the state's size.
_COUNT_CHARS = 1 << 18


def _solid(c: str) -> bool:
    # A character no definition of whitespace (Python's, Unicode White_Space, Oniguruma's \s) calls space.
    return c.isalnum() or "!" <= c <= "~"


@dataclass
class WindowPolicy:
    """What one tokenizer allows: whether windows are exact for it, and the added-token texts to stay clear of."""
    safe: bool
    added: tuple[str, ...] = ()
    margin: int = 0
    # Learnt from each window; a guess only costs speed, never exactness. Low at first: a window too small
    # grows by one more piece, one too large tokenizes what nobody keeps.
    chars_per_token: float = 2.5
    min_chars: int = _MIN_WINDOW_CHARS

    @classmethod
    def for_tokenizer(cls, tok: Any) -> WindowPolicy:
        try:
            doc = json.loads(tok.to_str())
        except Exception:
            return cls(False)
        pre, model = doc.get("pre_tokenizer") or {}, doc.get("model") or {}
        safe = (doc.get("normalizer") is None
                and pre.get("type") == "ByteLevel" and pre.get("add_prefix_space") is False
                and pre.get("use_regex", True) is True
                and model.get("type") == "BPE" and not model.get("dropout"))
        added = tuple(t["content"] for t in doc.get("added_tokens", []) if t.get("content"))
        if any(not t for t in added):
            safe = False
        return cls(safe, added, max((len(t) for t in added), default=0) + 1)

    def is_cut(self, text: str, p: int) -> bool:
        """Whether `p` is a safe cut of `text` (see the module docstring)."""
        if not (0 < p < len(text)) or text[p] not in _CUT_CHARS or not _solid(text[p - 1]):
            return False
        near = text[max(0, p - self.margin):p + self.margin]
        return not any(t in near for t in self.added)

    def cut_before(self, text: str, limit: int, floor: int) -> int | None:
        """The last safe cut in (floor, limit], or None (also after `_MAX_PROBES` rejected candidates)."""
        hi = limit + 1
        for _ in range(_MAX_PROBES):
            p = max(text.rfind(c, floor + 1, hi) for c in _CUT_CHARS)
            if p <= floor:
                return None
            if self.is_cut(text, p):
                return p
            hi = p
        return None

    def cut_after(self, text: str, limit: int, ceil: int) -> int | None:
        """The first safe cut in [limit, ceil), or None (also after `_MAX_PROBES` rejected candidates)."""
        lo = limit
        for _ in range(_MAX_PROBES):
            found = [q for q in (text.find(c, lo, ceil) for c in _CUT_CHARS) if q >= 0]
            if not found:
                return None
            p = min(found)
            if self.is_cut(text, p):
                return p
            lo = p + 1
        return None


_executor: tuple[int, ThreadPoolExecutor] | None = None
_executor_lock = threading.Lock()
_THREAD = "laya-state-tokens"


def _background() -> ThreadPoolExecutor:
    # One per process: an executor inherited through fork() has no thread and would never run anything.
    global _executor
    with _executor_lock:
        if _executor is None or _executor[0] != os.getpid():
            _executor = (os.getpid(), ThreadPoolExecutor(1, thread_name_prefix=_THREAD))
        return _executor[1]


_queued = 0                 # tasks given to the tokenizing thread and not finished (`alone`)


def _submit(fn: Callable[..., Any], *args: Any) -> Future:
    global _queued
    with _executor_lock:
        _queued += 1
    try:
        f = _background().submit(fn, *args)
    except BaseException:
        _finished(None)
        raise
    f.add_done_callback(_finished)
    return f


def _finished(_: Future | None) -> None:
    global _queued
    with _executor_lock:
        _queued -= 1


def alone() -> bool:
    """Whether no other Python thread of this process could want the GIL now: the caller's is the only one, but for
    this module's tokenizing thread with nothing to do (a client polling for its answer holds the GIL;
    client/receiver.py `Receiver._poll_lanes`)."""
    if _queued:
        return False
    n = threading.active_count()
    if n == 1:
        return True               # (asked before every spin: listing the threads took 2-3 us)
    ours = sum(t.name.startswith(_THREAD) for t in threading.enumerate())
    return n - ours == 1


def in_background(fn: Callable[..., Any], *args: Any) -> Future:
    """`fn(*args)` on the tokenizing thread (so an asyncio caller can await a long tokenization)."""
    return _submit(fn, *args)


@dataclass
class StateTokens:
    """The state's ids as far as rows need them: `ids` is the whole state, its first tokens (`from_left`
    False) or its last (`from_left` True); `count()` is the whole state's token count.

    For a window, the whole state is counted by `start()` in a background thread (`encode_request` calls it once
    the window is cut: the tokenizer releases the GIL, so the count runs beside the rows being built and sent and
    beside an in-process caller's forward) or, if nobody started it, by the first `count()` / `window_agrees()`. It
    is counted in pieces of about `_COUNT_CHARS` characters cut at safe cuts (`count_spans`), each piece's tokens
    dropped once counted: a client holds the window and one piece, never the whole state's tokens (which took
    ~200 bytes per byte of state), and `cancel()` stops it between two pieces (the call gave up). The first piece
    holds the window and goes past its cut, so the window is checked against tokens made without that cut."""
    ids: list[int]
    from_left: bool
    complete: bool
    _text: str = field(default="", repr=False)
    _encode: Callable[[str], list[int]] | None = field(default=None, repr=False)
    _policy: WindowPolicy | None = field(default=None, repr=False)
    _edge: int = 0                   # the window is text[:_edge] (or text[_edge:] from the left)
    _encode_many: Callable[[list[str]], list[list[int]]] | None = field(default=None, repr=False)
    _full: Future | None = field(default=None, repr=False)
    _cancelled: bool = field(default=False, repr=False)   # (a flag, not an Event: one per encode cost 3.5 us)

    def start(self) -> None:
        if not self.complete and self._full is None:
            self._full = _submit(self._count)

    def cancel(self) -> None:
        """Stop the count between two pieces (the call that wanted it has ended)."""
        self._cancelled = True

    def pending(self) -> Future | None:
        """The background count, while one runs (None once there is nothing to wait for)."""
        return None if self.complete or self._full is None or self._full.done() else self._full

    def count(self) -> int:
        return len(self.ids) if self.complete else self._counted()[0]

    def window_agrees(self) -> bool:
        """Whether the window is exactly the first (or last) tokens of the piece that holds it, tokenized whole."""
        return True if self.complete else self._counted()[1]

    def _counted(self) -> tuple[int, bool]:
        """(the whole state's token count, whether the window agrees); waits for the background count, re-raising
        what it raised."""
        if self._full is None:
            done: Future = Future()
            done.set_result(self._count())
            self._full = done
        return self._full.result()

    def _count(self) -> tuple[int, bool]:
        text, n, agrees = self._text, 0, True
        for i, (a, b) in enumerate(count_spans(self._policy, text, self._edge, self.from_left)):
            if self._cancelled:
                raise CancelledError("the call that wanted this count has ended")
            piece = text[a:b]
            ids = self._encode(piece) if self._encode_many is None else in_parts(self._encode_many, self._policy,
                                                                                  piece)
            if i == 0:
                w = len(self.ids)
                agrees = (ids[len(ids) - w:] if self.from_left else ids[:w]) == self.ids
            n += len(ids)
        self._text = ""                 # its serialized copy is not needed any more
        return n, agrees


def count_spans(policy: WindowPolicy, text: str, edge: int, from_left: bool,
                size: int | None = None) -> list[tuple[int, int]]:
    """`text` as pieces `(start, end)` of about `size` characters cut at safe cuts, in order from the window's side
    (from the left: from the end backwards); the first holds the window (`text[:edge]`, or `text[edge:]`) and at
    least `size` characters more. Where no safe cut is found, the rest is one piece."""
    size = _COUNT_CHARS if size is None else size
    out: list[tuple[int, int]] = []
    if not from_left:
        start, limit = 0, edge + size
        while start < len(text):
            p = None if limit >= len(text) else policy.cut_after(text, limit, len(text))
            end = len(text) if p is None else p
            out.append((start, end))
            start, limit = end, end + size
    else:
        end, limit = len(text), edge - size
        while end > 0:
            p = None if limit <= 0 else policy.cut_before(text, limit, 0)
            start = 0 if p is None else p
            out.append((start, end))
            end, limit = start, start - size
    return out


def tokenize_state(encode: Callable[[str], list[int]], policy: WindowPolicy, text: str, need: int,
                   from_left: bool, encode_many: Callable[[list[str]], list[list[int]]] | None = None) -> StateTokens:
    """Tokens of `text`: at least its first (`from_left`: last) `need` tokens, or all of them. `encode_many` (a
    batch of texts at once, on the tokenizer's threads) tokenizes a long window piece, and each piece of the whole
    state's count, in parts (`in_parts`)."""
    if not policy.safe or len(text) < max(policy.min_chars, 2 * need * policy.chars_per_token):
        return StateTokens(encode(text), from_left, True)
    try:
        if not text.isascii():          # (a flag of the string: no copy of a long ASCII state)
            text.encode("utf-8")
    except UnicodeEncodeError:          # the tokenizer refuses it: let it say so, as it does for the SDK
        return StateTokens(encode(text), from_left, True)
    parts: list[list[int]] = []
    got, edge = 0, (0 if not from_left else len(text))      # the window is text[:edge] or text[edge:]
    while got < need:
        reach = int((need - got) * policy.chars_per_token * _GROW) + 16
        # The safe cut nearest the size asked for: inside it, or past it when a long word fills it.
        if not from_left:
            at = edge + reach
            p = None if at >= len(text) else (policy.cut_before(text, at, edge)
                                              or policy.cut_after(text, at, len(text)))
            piece = text[edge:] if p is None else text[edge:p]
        else:
            at = edge - reach
            p = None if at <= 0 else policy.cut_after(text, at, edge) or policy.cut_before(text, at, 0)
            piece = text[:edge] if p is None else text[p:edge]
        ids = encode(piece) if encode_many is None else in_parts(encode_many, policy, piece)
        if ids:
            policy.chars_per_token = 0.5 * policy.chars_per_token + 0.5 * len(piece) / len(ids)
        parts.append(ids)
        got += len(ids)
        if p is None:                   # no safe cut left before the end: the window is the whole state
            return StateTokens(_join(parts, from_left), from_left, True)
        edge = p
    window = _join(parts, from_left)
    return StateTokens(window, from_left, False, text, encode, policy, edge, encode_many)


def split(policy: WindowPolicy, text: str, parts: int) -> list[str]:
    """`text` in at most `parts` pieces of near-equal length, cut only at safe cuts (`policy.safe`; otherwise whole):
    the pieces' tokens, joined, are the text's (the module docstring's lemma, once per cut)."""
    if not policy.safe or parts < 2:
        return [text]
    out, start = [], 0
    for i in range(1, parts):
        limit = len(text) * i // parts
        if limit <= start:              # (the cut before went past this part's end)
            continue
        p = policy.cut_before(text, limit, start) or policy.cut_after(text, limit, len(text))
        if p is None:
            break
        out.append(text[start:p])
        start = p
    out.append(text[start:])
    return out


def _cpus() -> int:
    """The CPUs this process may run on (the tokenizer's threads run there too)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def in_parts(encode_many: Callable[[list[str]], list[list[int]]], policy: WindowPolicy, text: str) -> list[int]:
    """The tokens of `text`, tokenized as parts of at least `_PART_CHARS` characters (at most one per CPU) cut at safe
    cuts, all in one batch: the same tokens as `text` whole, sooner."""
    out: list[int] = []
    for ids in encode_many(split(policy, text, min(_cpus(), len(text) // _PART_CHARS))):
        out.extend(ids)
    return out


def _join(parts: list[list[int]], from_left: bool) -> list[int]:
    out: list[int] = []
    for ids in (reversed(parts) if from_left else parts):
        out.extend(ids)
    return out
