"""The worker's reusable staging: one packed int32 input region and one float32 output region.

Allocated once per worker. On a GPU the host side is page-locked memory the workspace owns
(`PinnedBuffer`) and the device side a mirror with the same layout; every request packs into the same
host bytes and uploads the used prefix of each field, and every CUDA graph reads the same device
addresses, so a replay sees the new request. On the CPU the "device" mirror is the host memory itself.

Layout (int32, element offsets fixed by the capacity, so each field's address never moves):
    ids[max_tokens] | row_start[max_rows] | row_len[max_rows] | qtype[max_rows] | markers[max_rows * row_markers]
Output (float32): logits[max_rows * row_markers] | act[max_rows * n_act]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .batch import Batch

FIELDS = ("ids", "row_start", "row_len", "qtype", "markers")


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


class Workspace:
    def __init__(self, capacity: Capacity, n_act: int, device: torch.device):
        self.capacity, self.n_act, self.device = capacity, n_act, device
        c = capacity
        sizes = (c.max_tokens, c.max_rows, c.max_rows, c.max_rows, c.max_rows * c.row_markers)
        self.offsets = dict(zip(FIELDS, np.cumsum((0,) + sizes[:-1]).tolist()))
        self.sizes = dict(zip(FIELDS, sizes))
        self.in_elems = int(sum(sizes))
        self.out_elems = c.max_rows * c.row_markers + c.max_rows * n_act
        self.pinned = None
        if device.type == "cuda":
            from .cudart import PinnedBuffer
            self.pinned = PinnedBuffer(4 * (self.in_elems + self.out_elems))
            host_in = self.pinned.view(np.int32, 0, self.in_elems)
            host_out = self.pinned.view(np.float32, 4 * self.in_elems, self.out_elems)
            self.dev_in = torch.zeros(self.in_elems, dtype=torch.int32, device=device)
        else:
            host_in = np.zeros(self.in_elems, np.int32)
            host_out = np.zeros(self.out_elems, np.float32)
            self.dev_in = torch.from_numpy(host_in)      # the CPU forward reads the staging directly
        self.host_in, self.host_out = host_in, host_out
        self.host = {f: host_in[self.offsets[f]: self.offsets[f] + self.sizes[f]] for f in FIELDS}
        self.dev = {f: self.dev_in[self.offsets[f]: self.offsets[f] + self.sizes[f]] for f in FIELDS}
        k = c.max_rows * c.row_markers
        self.out_logits, self.out_act = host_out[:k], host_out[k:]
        self._starts = np.zeros(c.max_rows + 1, np.int64)

    @property
    def host_address(self) -> int:
        return int(self.host_in.ctypes.data)

    @property
    def device_address(self) -> int:
        return int(self.dev_in.data_ptr())

    def pack(self, batch: Batch, shape: Shape) -> list[tuple[int, int]]:
        """Write `batch` into the staging laid out for `shape`; return the (offset, count) spans to upload.

        Padding rows get length 0 and no markers, so the forward ignores them; every marker slot of the
        shape is rewritten, so nothing of an earlier request can leak into this one.
        """
        r, rows, k = batch.rows, shape.rows, shape.row_markers
        h = self.host
        h["ids"][: batch.tokens] = batch.ids
        starts = self._starts[: r + 1]
        np.cumsum(batch.lengths, out=starts[1:])
        h["row_start"][:r] = starts[:r]
        h["row_len"][:r] = batch.lengths
        h["qtype"][:r] = batch.types
        for f in ("row_start", "row_len", "qtype"):
            h[f][r:rows] = 0
        mk = h["markers"][: rows * k].reshape(rows, k)
        mk.fill(-1)
        o = 0
        for i, c in enumerate(batch.marker_counts.tolist()):
            mk[i, :c] = batch.markers[o: o + c]
            o += c
        return [(self.offsets["ids"], batch.tokens), (self.offsets["row_start"], rows),
                (self.offsets["row_len"], rows), (self.offsets["qtype"], rows),
                (self.offsets["markers"], rows * k)]

    def views(self, shape: Shape) -> tuple[torch.Tensor, ...]:
        """Device tensors the forward reads for `shape`: always the same addresses for the same shape."""
        d, rows, k = self.dev, shape.rows, shape.row_markers
        return (d["ids"], d["row_start"][:rows], d["row_len"][:rows], d["qtype"][:rows],
                d["markers"][: rows * k].view(rows, k))

    def close(self) -> None:
        if self.pinned is not None:
            self.host_in = self.host_out = self.out_logits = self.out_act = None
            self.host = {}
            self.pinned.close()
            self.pinned = None
