"""A batch (the rows one forward runs) and their validation, whole, before CUDA sees any of it.

A request arrives as rows sharing one upload: packed token ids, a length, a question type and
marker positions per row; its batch is those rows (a merged group's batch is its members' rows back to
back, see merge.py). Everything is checked here, on the host, so a bad request costs a clear
error and nothing else: the workspace and the device are untouched and the next request works.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from laya_pool.protocol import wire
from laya_pool.protocol.qtypes import QUESTION_TYPES

MAX_QTYPE = len(QUESTION_TYPES) - 1
_PLAIN_MARKERS = 256        # `plainly_valid` walks this many markers in Python at most; more go to `check_values`
_INT32 = range(-(1 << 31), 1 << 31)
_QTYPE_TEXT = ", ".join(str(t.id) for t in QUESTION_TYPES if t.id < MAX_QTYPE) + f" or {MAX_QTYPE}"   # "0, 1 or 2"


class RequestError(ValueError):
    """A request we refuse, naming the field and (where there is one) the row."""

    def __init__(self, field: str, message: str, row: int | None = None):
        self.field, self.row = field, row
        where = f"{field}" if row is None else f"{field} (row {row})"
        super().__init__(f"{where}: {message}")

    def to_dict(self) -> dict:
        return {"field": self.field, "row": self.row, "message": str(self)}


@dataclass
class Batch(wire.Rows):
    """One request's rows as the runtime takes them (`wire.Rows` plus what bucketing needs)."""

    # A few dozen rows at most: a Python max over the list beats a numpy reduction's call overhead. Cached: a
    # request's longest row is read as it joins a group (its padding), by the group, and by its bucket (arrays are
    # never written after a Batch is made).
    @cached_property
    def max_row_len(self) -> int:
        return max(self.lengths.tolist()) if self.rows else 0

    @cached_property
    def max_row_markers(self) -> int:
        return max(self.marker_counts.tolist()) if self.rows else 0

    @classmethod
    def from_rows(cls, rows: list[tuple[np.ndarray, np.ndarray, int]]) -> Batch:
        """Pack `(ids, markers, qtype)` rows, the shape the client produces, with the client's packer.

        Rows already in the packed form (`encode_request`'s: 1-D int32 arrays, int question types) are packed
        here in one pass, into the same arrays `wire.pack_rows` makes; any other row goes through it, and so
        gets its conversions and its errors."""
        rows = list(rows)
        if not rows or not all(_packed(ids) and _packed(mk) and type(q) is int and q in _INT32 for ids, mk, q in rows):
            return cls(**wire.pack_rows(rows))
        return cls(ids=np.concatenate([r[0] for r in rows]),
                   lengths=np.array([len(r[0]) for r in rows], wire.I32),
                   types=np.array([r[2] for r in rows], wire.I32),
                   marker_counts=np.array([len(r[1]) for r in rows], wire.I32),
                   markers=np.concatenate([r[1] for r in rows]))


def _packed(a: object) -> bool:
    return type(a) is np.ndarray and a.ndim == 1 and a.dtype == wire.I32


@dataclass(frozen=True)
class Limits:
    vocab_size: int
    max_len: int
    max_tokens: int
    max_rows: int
    max_markers: int


def _first_bad_row(bad: np.ndarray) -> int:
    return int(np.flatnonzero(bad)[0])


def validate(batch: Batch, limits: Limits) -> None:
    """Raise `RequestError` for the first thing wrong with the whole group; return silently if all is well."""
    validate_structure(batch, limits)
    validate_values(batch, limits)


def validate_structure(batch: Batch, limits: Limits, parsed: bool = False) -> None:
    """What ties a request's arrays together (types, sizes, the lengths' and the marker counts' sums) and its size
    against the capacity. Once each request of a group passes this, the group's rows line up with its members'
    rows, so `validate_values` on the merged group passes exactly when it passes on every member (the worker
    checks the values of a group at once, and each member apart only when the group fails: worker/compute.py).

    `parsed`: the arrays are `wire.parse_request`'s, cut from one int32 buffer by the header's counts, so each is
    1-D int32 and types and marker counts have a row each already (a worker skips those checks: 0.8 us a request)."""
    if not parsed:
        for name in wire.REQUEST_ARRAYS:
            arr = getattr(batch, name)
            if not isinstance(arr, np.ndarray) or arr.dtype != np.int32 or arr.ndim != 1:
                raise RequestError(name, f"must be a 1-D int32 array, got {getattr(arr, 'dtype', type(arr))}")
    r = batch.rows
    if r == 0:
        raise RequestError("lengths", "a request needs at least one row")
    if r > limits.max_rows:
        raise RequestError("lengths", f"{r} rows exceed this worker's capacity of {limits.max_rows}")
    if not parsed:
        for name in ("types", "marker_counts"):
            if getattr(batch, name).shape[0] != r:
                raise RequestError(name, f"has {getattr(batch, name).shape[0]} entries for {r} rows")
    _check_tokens(batch, limits, sum(batch.lengths.tolist()))
    _check_markers(batch, limits, sum(batch.marker_counts.tolist()))


def _check_tokens(batch: Batch, limits: Limits, total: int) -> None:
    """`total`, the lengths' sum, against the ids and the capacity."""
    if total != batch.tokens:
        raise RequestError("ids", f"has {batch.tokens} tokens but the lengths add up to {total}")
    if total > limits.max_tokens:
        raise RequestError("ids", f"{total} tokens exceed this worker's capacity of {limits.max_tokens}")


def _check_markers(batch: Batch, limits: Limits, m: int) -> None:
    """`m`, the marker counts' sum, against the markers and the capacity."""
    if m != batch.n_markers:
        raise RequestError("markers", f"has {batch.n_markers} entries but the marker counts add up to {m}")
    if m > limits.max_markers:
        raise RequestError("markers", f"{m} markers exceed this worker's capacity of {limits.max_markers}")


def validate_values(batch: Batch, limits: Limits) -> None:
    """Each row's and each token's values (lengths, ids, types, markers), on a batch `validate_structure` passed."""
    if not plainly_valid(batch, limits):
        check_values(batch, limits)


def plainly_valid(batch: Batch, limits: Limits) -> bool:
    """True only if `check_values` would pass: a request of a few dozen rows (the common one) checked on Python
    lists, where `check_values` pays a numpy call per rule. False means "look closer", not "invalid":
    `check_values` then finds the first error, field and row."""
    lengths, counts, types = batch.lengths.tolist(), batch.marker_counts.tolist(), batch.types.tolist()
    if min(lengths) < 1 or max(lengths) > limits.max_len:
        return False
    n = sum(lengths)
    if n != batch.tokens or n > limits.max_tokens:
        return False
    ids = batch.ids
    if ids.min() < 0 or ids.max() >= limits.vocab_size:
        return False
    if min(types) < 0 or max(types) > MAX_QTYPE:
        return False
    m = sum(counts)
    if min(counts) < 1 or m != batch.n_markers or m > limits.max_markers or m > _PLAIN_MARKERS:
        return False
    return _markers_plainly_valid(batch.markers.tolist(), lengths, counts)


def _markers_plainly_valid(markers: list[int], lengths: list[int], counts: list[int]) -> bool:
    """Every row's markers strictly ascending inside 0..length-1."""
    o = 0
    for n, c in zip(lengths, counts):
        last = -1
        for x in markers[o:o + c]:
            if x <= last:
                return False
            last = x
        if last >= n:
            return False
        o += c
    return True


def check_values(batch: Batch, limits: Limits) -> None:
    """The values of a batch whose arrays have the right types and sizes: raise `RequestError` for the first
    thing wrong, naming the field and the row."""
    r = batch.rows
    lengths = batch.lengths
    bad = (lengths < 1) | (lengths > limits.max_len)
    if bad.any():
        i = _first_bad_row(bad)
        raise RequestError("lengths", f"length {int(lengths[i])} is outside 1..{limits.max_len}", i)
    _check_tokens(batch, limits, int(lengths.astype(np.int64).sum()))
    bad = (batch.ids < 0) | (batch.ids >= limits.vocab_size)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        row = int(np.searchsorted(np.cumsum(lengths), pos, side="right"))
        raise RequestError("ids", f"token {int(batch.ids[pos])} at position {pos} is outside the vocabulary "
                                  f"0..{limits.vocab_size - 1}", row)
    bad = (batch.types < 0) | (batch.types > MAX_QTYPE)
    if bad.any():
        i = _first_bad_row(bad)
        raise RequestError("types", f"question type {int(batch.types[i])} is not {_QTYPE_TEXT}", i)
    counts = batch.marker_counts
    bad = counts < 1
    if bad.any():
        raise RequestError("marker_counts", "every row needs at least one marker", _first_bad_row(bad))
    m = int(counts.astype(np.int64).sum())
    _check_markers(batch, limits, m)
    row_of = np.repeat(np.arange(r), counts)
    mk = batch.markers
    bad = (mk < 0) | (mk >= lengths[row_of])
    if bad.any():
        j = _first_bad_row(bad)
        raise RequestError("markers", f"marker {int(mk[j])} is outside its row of length {int(lengths[row_of[j]])}",
                           int(row_of[j]))
    # Ascending and unique inside each row: compare each marker with its predecessor in the same row.
    if m > 1:
        same_row = row_of[1:] == row_of[:-1]
        bad = same_row & (mk[1:] <= mk[:-1])
        if bad.any():
            j = _first_bad_row(bad) + 1
            raise RequestError("markers", "markers must be strictly ascending inside a row", int(row_of[j]))
