"""When a group that is not full launches while another computes: a little before that one lands.

The compute thread forms the next group while a launched one computes (worker/compute.py `_more`). A full group
launches at once and queues behind the computing one; a group that is not full used to wait until the computing one
landed, so the device idled while the worker noticed the landing and packed, uploaded and launched the next group
(0.1-0.2 ms a group on the device hosts: ~5% of a 32x48 group's 3 ms, most of what separated throughput at 64 in
flight from 1 / group time there; docs/PERF.md, twenty-eighth session). `Pace` learns how long a group keeps the
device (a landing minus when its device work could start: its launch, or the landing before it) and names the moment
to launch instead: the computing group's expected landing less `lead`, the time a launch takes to reach the device.
A group launched early takes what arrived by then; one arriving later waits for the next group, which it would have
done anyway had the launch come after the landing. Until a group has been timed, and with `lead` 0, nothing changes.
Pure logic on times the caller gives, so it is tested alone.
"""
from __future__ import annotations

import os

LEAD_MS = 0.3        # LAYA_LAUNCH_LEAD_MS: pack + upload + launch (p95 0.13-0.16 ms on the H100 hosts) with room
WEIGHT = 0.25        # of the newest group in the running estimate of a group's device time


def lead_from_env() -> float:
    """LAYA_LAUNCH_LEAD_MS in seconds (0: launch a group that is not full only once the one before landed)."""
    raw = os.environ.get("LAYA_LAUNCH_LEAD_MS")
    ms = LEAD_MS if raw in (None, "") else float(raw)
    if ms < 0:
        raise ValueError(f"LAYA_LAUNCH_LEAD_MS must be >= 0, got {raw!r}")
    return ms / 1e3


class Pace:
    def __init__(self, lead_s: float = LEAD_MS / 1e3, weight: float = WEIGHT):
        self.lead, self.weight = lead_s, weight
        self.group_s: float | None = None    # a group's device time, running estimate
        self.last_landed: float | None = None

    def start_of(self, launched: float) -> float:
        """When a group launched at `launched` could start on the device: then, or when the group ahead of it landed
        (groups run in launch order, and the one ahead has landed by the time this is asked)."""
        return launched if self.last_landed is None else max(launched, self.last_landed)

    def landed(self, launched: float, landed: float) -> None:
        """The oldest launched group, launched at `launched`, landed at `landed` (groups land in launch order)."""
        took = landed - self.start_of(launched)
        if took > 0:
            self.group_s = took if self.group_s is None else self.group_s + self.weight * (took - self.group_s)
        self.last_landed = landed

    def launch_by(self, launched: float) -> float | None:
        """When to launch the group being formed behind the one computing (launched at `launched`, nothing ahead of
        it), or None: only once that one has landed."""
        if self.lead <= 0 or self.group_s is None:
            return None
        return self.start_of(launched) + self.group_s - self.lead
