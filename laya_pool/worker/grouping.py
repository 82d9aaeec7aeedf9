"""Which requests share a forward (dynamic batching, worker/merge.py `Group`): each request is admitted (it may
run here, or it is answered now), then merged with those that arrive while it waits, up to `--max-batch` requests and
`--merge-waste` padding tokens; what is set aside goes first in line for the next group.

A mixin of `Compute` (worker/compute.py), which holds the runtime (`rt`), the requests set aside (`waiting`), the
limits (`max_group`, `merge_waste`, `row_step`), the counters and `reply`, and gives the next arrival (`_more`).
"""
from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from laya_pool.protocol import wire
from laya_pool.protocol.contract import Reason

from .batch import Batch, RequestError
from .merge import Group

log = logging.getLogger("laya-pool.worker")

DONE = object()        # `Compute._more` and its waits: launch the group being formed now (or: a launched one landed)


@dataclass
class Queued:
    """A request taken from the broker, waiting for (or in) the compute thread."""
    session: int          # the registration it arrived under
    req: wire.Request
    received: float       # time.monotonic() when the I/O thread decoded it
    expires: float | None = None   # when its caller gives up (this host's monotonic clock); None: no deadline
    to: Any = None     # a client's own request: its identity on the direct socket, or its lane (None: the broker's)

    @classmethod
    def of(cls, session: int, req: wire.Request, received: float, to: Any = None) -> Queued:
        """`req` as it arrived at `received`: its budget (the caller's time left) counts from then."""
        expires = None if req.budget_ms is None else received + req.budget_ms / 1e3
        return cls(session, req, received, expires, to)


class Grouping:
    """Admission and grouping, for `Compute`."""

    def admit(self, q: Queued) -> Batch | None:
        """The request's rows if this worker can run them; otherwise answer it here and return None."""
        req = q.req
        if self.faults.hang_rows and len(req.lengths) == self.faults.hang_rows:
            log.warning("worker %s: LAYA_WORKER_HANG_ROWS: hanging on request %s", self.id, req.tag,
                        extra={"request": req.tag})
            threading.Event().wait()
        if q.session != self.session and q.to is None:     # (a client's own request is no broker's to re-send)
            self.counts["dropped"] += 1
            self.reply(self._error(req, wire.STATUS_RETRYABLE, "dropped after re-registering", reason=Reason.STALE),
                       q.to)
            return None
        if q.expires is not None and time.monotonic() >= q.expires:
            # Its caller has given up: computing it would only delay the requests behind it.
            self.counts["expired"] += 1
            self.reply(self._error(req, wire.STATUS_RETRYABLE, f"worker {self.id}: the request's deadline passed "
                                   "before compute started", reason=Reason.EXPIRED), q.to)
            return None
        try:
            batch = Batch(req.ids, req.lengths, req.types, req.marker_counts, req.markers)    # (0.2 us; by names 0.7)
            # (its arrays are parse_request's; its values are checked with its group's, `_valid`)
            self.rt.check_request(batch, mode=req.mode, taps=req.taps, parsed=True)
            return batch
        except Exception as e:  # noqa: BLE001 - host-side only (no device work yet): refuse this one request
            self._refuse(q, e, "read")
            return None

    def _refuse(self, q: Queued, e: Exception, doing: str) -> None:
        """Answer `q`, whose host-side check raised `e`: a `RequestError` names its field and row; anything else is
        an internal error of this request alone (no device work was done for it)."""
        if isinstance(e, RequestError):
            self.counts["request_errors"] += 1
            self.reply(self._refusal(q.req, e), q.to)
            return
        self.counts["internal_errors"] += 1
        log.exception("worker %s: could not %s request %s", self.id, doing, q.req.tag, extra={"request": q.req.tag})
        self.reply(self._internal(q.req, e), q.to)

    def take_group(self, first: Queued, more: bool = True) -> tuple[list[Queued], Group, bool]:
        """`first` and the requests that can share its forward: (the members, their rows as a Group in the same
        order, whether the stop sentinel was seen). Requests set aside before (`waiting`) are offered first, then
        what arrives (`more`: the sentinel is not read yet).

        Only requests in the worker's own mode without taps are merged; one that asks for something else
        runs alone. A request that would overflow the workspace ends the group; one that would take the group's
        padding (`Group.waste`) past `merge_waste` tokens is set aside, and the group goes on without it. What is
        set aside stays in arrival order, first in line for the next group."""
        members: list[Queued] = []
        group = Group(step=self.row_step)
        earlier, self.waiting = self.waiting, deque()
        kept: list[Queued] = []           # set aside from `earlier`: older than what is left there
        later: list[Queued] = []          # set aside from new arrivals
        stop = False
        q: Queued | None = first
        aside = later                     # where `q` goes if set aside (`first` is never: it leads the group)
        try:
            while q is not None:
                special = q.req.taps or q.req.mode not in (None, self.rt.config.mode)
                if members and special:
                    aside.append(q)
                    break
                batch = self.admit(q)
                if batch is not None:
                    if members and not group.admits(batch, self.rt.capacity):
                        aside.append(q)
                        break
                    if members and self.merge_waste is not None and group.waste(batch) > self.merge_waste:
                        self.counts["set_aside"] += 1
                        aside.append(q)
                    else:
                        group.add(batch)
                        members.append(q)
                        if special:
                            break
                # Enough set aside for a group of their own: launch this one, they come next.
                if len(members) >= self.max_group or len(kept) + len(later) >= self.max_group:
                    break
                aside = kept if earlier else later
                nxt = earlier.popleft() if earlier else (self._more() if more else DONE)
                if nxt is DONE:
                    break
                if nxt is None:
                    stop = True
                    break
                q = nxt
        finally:                          # (an answer that raised must not drop what waits)
            self.waiting.extend(kept)
            self.waiting.extend(earlier)
            self.waiting.extend(later)
        return members, group, stop

    def _valid(self, members: list[Queued], group: Group) -> tuple[list[Queued], Group]:
        """The members whose rows' values pass, and their group; each other one refused, naming its field and row.

        `admit` checked each request's structure, so the merged rows line up with the members' and one check of the
        group's values passes exactly when every member's would (worker/batch.py `validate_structure`): ~30 numpy
        and list passes a group instead of a member. Only a group that fails is checked member by member. Host work
        alone, so anything it raises is one request's refusal (as in `admit`), never a device failure."""
        try:
            self.rt.check_values(group.merged())
            return members, group
        except Exception:  # noqa: BLE001 - whose rows they are is found member by member
            pass
        kept: list[Queued] = []
        batches = []
        for q, batch in zip(members, group.batches):
            try:
                self.rt.check_values(batch)
            except Exception as e:  # noqa: BLE001 - host-side only: refuse this one request
                self._refuse(q, e, "check")
                continue
            kept.append(q)
            batches.append(batch)
        return kept, Group(batches)
