"""Dynamic batching: the rows of several queued requests run as one forward, each gets its own answer.

A decision loop sends many small requests; one forward of 32 one-row requests costs little more than
one of them (the GPU is far from busy at 1x48), so a worker that merges what is queued serves many
times the requests per second. It is safe on CUDA because a row's answer does not depend on the rows
around it (batch-invariant GEMMs, per-row attention, padding-invariant reductions): a merged request's
answer is byte-identical to its answer alone. CPU GEMMs are not batch-invariant (merged answers move
in the 6th decimal), so CPU workers merge only when asked.

A forward pads every row to the group's longest, so a short request beside a long one costs the long one's time:
a group takes a request only while its padding stays under a bound (`Group.waste`, the worker's --merge-waste, in
tokens, row lengths rounded to the runtime's bucket step); one refused so waits, first in line for a later group
(worker/compute.py `take_group`).

Each request's structure is checked before it joins a group, and the group's values once before it runs; a
group that fails is checked member by member (worker/compute.py `_valid`), so a bad request is refused alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .batch import Batch

if TYPE_CHECKING:                      # the workspace module pulls in torch; the worker's I/O side need not
    from .workspace import Capacity


@dataclass
class Group:
    """Requests' batches packed back to back, and where each one's rows and markers sit."""
    batches: list[Batch] = field(default_factory=list)
    step: int = 1              # row lengths as the forward pads them: rounded up to the runtime's bucket step
    # Running totals: admitting a request is O(1), not a sum over the group (32 requests a group at load).
    tokens: int = field(init=False, default=0)
    rows: int = field(init=False, default=0)
    n_markers: int = field(init=False, default=0)
    row_len: int = field(init=False, default=0)      # the longest (padded) row: the forward pads every row to it
    area: int = field(init=False, default=0)         # what the members pad to alone: sum of rows x (padded) longest
    _merged: Batch | None = field(init=False, default=None, repr=False, compare=False)   # `merged`, until an `add`

    def __post_init__(self) -> None:
        batches, self.batches = self.batches, []
        for b in batches:
            self.add(b)

    def admits(self, b: Batch, cap: Capacity) -> bool:
        return (self.tokens + b.tokens <= cap.max_tokens and self.rows + b.rows <= cap.max_rows
                and self.n_markers + b.n_markers <= cap.max_markers)

    def waste(self, b: Batch) -> int:
        """The padding tokens the group's forward would compute with `b` in it beyond what each member pads to
        alone: rows shorter than the longest are padded to it (a 48-token row beside a 256-token one: 208)."""
        n = self._padded(b)
        return (self.rows + b.rows) * max(self.row_len, n) - self.area - b.rows * n

    def _padded(self, b: Batch) -> int:
        return -(-b.max_row_len // self.step) * self.step

    def add(self, b: Batch) -> None:
        self.batches.append(b)
        self._merged = None
        self.tokens += b.tokens
        self.rows += b.rows
        self.n_markers += b.n_markers
        n = self._padded(b)
        self.row_len = max(self.row_len, n)
        self.area += b.rows * n

    def merged(self) -> Batch:
        """The members' rows back to back (made once: the worker checks the group's values, then launches it)."""
        if len(self.batches) == 1:
            return self.batches[0]
        if self._merged is None:
            self._merged = self._concatenated()
        return self._merged

    def _concatenated(self) -> Batch:
        cat = np.concatenate
        return Batch(ids=cat([b.ids for b in self.batches]), lengths=cat([b.lengths for b in self.batches]),
                     types=cat([b.types for b in self.batches]),
                     marker_counts=cat([b.marker_counts for b in self.batches]),
                     markers=cat([b.markers for b in self.batches]))

    def split(self, logits: np.ndarray, act: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
        """The merged forward's outputs cut back into one (logits, act) per request, in order."""
        out = []
        m = r = 0
        for b in self.batches:
            out.append((logits[m:m + b.n_markers], act[r:r + b.rows]))
            m += b.n_markers
            r += b.rows
        return out
