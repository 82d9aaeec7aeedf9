"""The worker's reusable staging: packed int32 input regions and float32 output regions.

Allocated once per worker. On a GPU the host side is page-locked memory the workspace owns
(`PinnedBuffer`), cut into `slots` (two by default: group N+1 packs into one while group N's copies and
readback use the other; worker/slots.py says when a slot may be written), and the device side is ONE input
mirror with the same layout: every CUDA graph reads the same device addresses, so a replay sees the new
request, and the stream orders group N+1's upload after group N's compute has read the mirror. On the CPU
the forward runs synchronously and reads the host staging in place, so one slot is all there is.

Layout of one slot (int32, element offsets fixed by the capacity, so each field's address never moves):
    row_start[max_rows] | row_len[max_rows] | qtype[max_rows] | markers[max_rows * row_markers] | ids[max_tokens]
The ids come last so that one copy from the slot's start to the request's last token uploads a group (the markers
past the shape's go along unread): each cudaMemcpyAsync costs the host ~10 us on an H100 host
(docs/decisions/0028-host-path-taken-apart.md).
Output (float32, per slot): a shape's logits[rows * row_markers], then its act[rows * n_act] from `act_at`, as the
forward lays them out on the device (kernels/fast.py), so one copy reads a group's answers back.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from laya_pool.kernels.fast import act_at

from .batch import Batch

FIELDS = ("row_start", "row_len", "qtype", "markers", "ids")      # in the slot's order
ALIGN = 16             # elements: every field starts 64-byte aligned, as act does in the outputs (`act_at`); Triton's
                       # kernels are specialised on 16-byte alignment, an allocation of its own is aligned more


@dataclass(frozen=True)
class Capacity:
    max_tokens: int = 16384
    max_rows: int = 64
    max_markers: int = 2048
    row_markers: int = 128      # markers one row may carry (the widest option list a question can have)


@dataclass(frozen=True, order=True)
class Shape:
    """The padded shape a forward runs at: rows, the padded row width, markers per row."""
    rows: int
    row_len: int
    row_markers: int

    def fits(self, batch: Batch) -> bool:
        return (batch.rows <= self.rows and batch.max_row_len <= self.row_len
                and batch.max_row_markers <= self.row_markers)

    def text(self) -> str:
        """ROWSxLENGTHxMARKERS, as --warmup-shapes writes a bucket."""
        return f"{self.rows}x{self.row_len}x{self.row_markers}"


@dataclass
class Slot:
    """One slot's host side: the packed inputs (by field) and the outputs the readback lands in."""
    host_in: np.ndarray
    host: dict[str, np.ndarray]
    out: np.ndarray             # a group's logits, then its act from `act_at` (see the module's docstring)


def readbacks(logits: torch.Tensor, act: torch.Tensor, shape: Shape) -> tuple[tuple[int, int, int], ...]:
    """The copies that read a forward's answers for `shape` back into a slot's outputs: `(byte offset in the outputs,
    device address, bytes)`. One where the forward laid act out as the slot holds it, `act_at` after the logits
    (kernels/fast.py); else one each."""
    at = 4 * act_at(shape.rows, shape.row_markers)
    lo, n_lo, ac, n_ac = logits.data_ptr(), 4 * logits.numel(), act.data_ptr(), 4 * act.numel()
    if ac == lo + at:
        return ((0, lo, at + n_ac),)
    return ((0, lo, n_lo), (at, ac, n_ac))


class Workspace:
    def __init__(self, capacity: Capacity, n_act: int, device: torch.device, slots: int = 1):
        self.capacity, self.n_act, self.device = capacity, n_act, device
        c = capacity
        self.sizes = {"row_start": c.max_rows, "row_len": c.max_rows, "qtype": c.max_rows,
                      "markers": c.max_rows * c.row_markers, "ids": c.max_tokens}
        self.offsets, at = {}, 0
        for f in FIELDS:                 # each field 64-byte aligned, whatever the capacity
            self.offsets[f], at = at, at + -(-self.sizes[f] // ALIGN) * ALIGN
        self.in_elems = self.offsets["ids"] + self.sizes["ids"]
        self.out_elems = act_at(c.max_rows, c.row_markers) + c.max_rows * n_act
        self.pinned = None
        per_slot = self.in_elems + self.out_elems
        if device.type == "cuda":
            from .cudart import PinnedBuffer
            self.pinned = PinnedBuffer(4 * per_slot * slots)
            regions = [(self.pinned.view(np.int32, 4 * per_slot * i, self.in_elems),
                        self.pinned.view(np.float32, 4 * (per_slot * i + self.in_elems), self.out_elems))
                       for i in range(slots)]
            self.dev_in = torch.zeros(self.in_elems, dtype=torch.int32, device=device)
        else:
            # The CPU forward reads each slot's staging in place (one slot unless a test asks for two).
            regions = [(np.zeros(self.in_elems, np.int32), np.zeros(self.out_elems, np.float32))
                       for _ in range(slots)]
            self.dev_in = torch.from_numpy(regions[0][0])
        self.slots = [Slot(host_in, {f: host_in[self.offsets[f]: self.offsets[f] + self.sizes[f]] for f in FIELDS},
                           host_out) for host_in, host_out in regions]
        mirrors = [self.dev_in] if device.type == "cuda" else [torch.from_numpy(r[0]) for r in regions]
        self.dev_slots = [{f: m[self.offsets[f]: self.offsets[f] + self.sizes[f]] for f in FIELDS} for m in mirrors]
        self.dev = self.dev_slots[0]
        self._blank: dict[str, torch.Tensor] | None = None

    # Slot 0's host side under the names a one-slot workspace had (the uploads, the runtime and tests use them).
    @property
    def host_in(self) -> np.ndarray:
        return self.slots[0].host_in

    @property
    def out(self) -> np.ndarray:
        return self.slots[0].out

    def outputs(self, slot: int, shape: Shape) -> tuple[np.ndarray, np.ndarray]:
        """Where `shape`'s logits [rows * row_markers] and act [rows * n_act] land in slot `slot`."""
        r, k = shape.rows, shape.row_markers
        at, out = act_at(r, k), self.slots[slot].out
        return out[: r * k], out[at: at + r * self.n_act]

    @property
    def host_address(self) -> int:
        return int(self.slots[0].host_in.ctypes.data)

    @property
    def device_address(self) -> int:
        return int(self.dev_in.data_ptr())

    def pack(self, batch: Batch, shape: Shape, slot: int = 0) -> list[tuple[int, int]]:
        """Write `batch` into slot `slot` laid out for `shape`; return the (offset, count) spans to upload (one).

        Padding rows get length 0 and no markers, so the forward ignores them; every marker slot of the
        shape is rewritten, so nothing of an earlier request can leak into this one.
        """
        r, rows, k = batch.rows, shape.rows, shape.row_markers
        h = self.slots[slot].host
        h["ids"][: batch.tokens] = batch.ids
        # A few dozen rows: summed in Python, a third of what np.cumsum's call costs.
        h["row_start"][:r] = list(itertools.accumulate(batch.lengths.tolist(), initial=0))[:r]
        h["row_len"][:r] = batch.lengths
        h["qtype"][:r] = batch.types
        if rows > r:
            for f in ("row_start", "row_len", "qtype"):
                h[f][r:rows] = 0
        mk = h["markers"][: rows * k].reshape(rows, k)
        mk.fill(-1)
        o = 0
        for i, c in enumerate(batch.marker_counts.tolist()):
            mk[i, :c] = batch.markers[o: o + c]
            o += c
        # One copy, not one per field: the fields lie back to back (FIELDS' order) with the ids last, so one span from
        # the slot's start to the last token holds them all; the tails between them (rows and markers past this
        # shape's) go along unread.
        return [(0, self.offsets["ids"] + batch.tokens)]

    def views(self, shape: Shape, slot: int = 0) -> tuple[torch.Tensor, ...]:
        """Device tensors the forward reads for `shape`: always the same addresses for the same shape (on CUDA
        every slot uploads into the one mirror; on the CPU each slot is read in place)."""
        return self._cut(self.dev_slots[slot % len(self.dev_slots)], shape)

    def blank_views(self, shape: Shape) -> tuple[torch.Tensor, ...]:
        """Views of `shape` into a mirror that holds no request (every row empty, no markers), laid out like the
        real one (same offsets, so the same alignment and strides: the kernels a forward over it compiles are the
        ones a capture over the real mirror launches). What a forward runs on when no request was packed for its
        shape: the real mirror holds the last group's fields, laid out for *that* group's shape, and its row
        starts and lengths can reach past this shape's tokens (a forward over them writes out of its buffers)."""
        if self._blank is None:
            m = torch.zeros(self.in_elems, dtype=torch.int32, device=self.dev_in.device)
            self._blank = {f: m[self.offsets[f]: self.offsets[f] + self.sizes[f]] for f in FIELDS}
            self._blank["markers"].fill_(-1)
        return self._cut(self._blank, shape)

    @staticmethod
    def _cut(d: dict[str, torch.Tensor], shape: Shape) -> tuple[torch.Tensor, ...]:
        rows, k = shape.rows, shape.row_markers
        return (d["ids"], d["row_start"][:rows], d["row_len"][:rows], d["qtype"][:rows],
                d["markers"][: rows * k].view(rows, k))

    def close(self) -> None:
        if self.pinned is not None:
            self.slots = []
            self.pinned.close()
            self.pinned = None
