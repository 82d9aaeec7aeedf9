"""Staging slots: which pinned host slot the next group packs into, and when a slot may be written again.

A CUDA worker keeps two groups going: while group N computes, group N+1 is validated, packed into the other
slot's pinned host bytes and its copies queued behind N on the same stream (docs/architecture.md, "Overlap").
The host must never rewrite a slot whose copies may still be reading it, nor reuse a slot whose answers it
has not read yet. This ledger is that rule and nothing else (no CUDA), so it can be tested alone:

    FREE --acquire--> PACKING --submitted--> QUEUED --release--> FREE
                         \\__________________release (a launch that failed and drained)__/

- only a PACKING slot may be written by the host (`writable`);
- a QUEUED slot is released only after its done event fired (its copies finished long before: the readback
  comes after them on the stream), and after its outputs were read;
- a slot that failed while PACKING or QUEUED is released only once the stream was drained (upload.py).
"""
from __future__ import annotations

from enum import Enum


class SlotState(str, Enum):
    FREE = "free"
    PACKING = "packing"        # the host is writing its inputs; nothing on the device reads it
    QUEUED = "queued"          # copies, compute and readback queued: the host must neither write nor read it


class SlotError(RuntimeError):
    """A slot used out of turn: a bug in the caller, never a request's fault."""


class SlotLedger:
    def __init__(self, n: int):
        if n < 1:
            raise ValueError("a workspace needs at least one staging slot")
        self.states = [SlotState.FREE] * n
        self.launched = 0                 # groups that reached QUEUED, for stats

    @property
    def n(self) -> int:
        return len(self.states)

    @property
    def in_flight(self) -> int:
        return sum(s is not SlotState.FREE for s in self.states)

    def free(self) -> int | None:
        """The lowest free slot, or None when every slot holds a group."""
        for i, s in enumerate(self.states):
            if s is SlotState.FREE:
                return i
        return None

    def acquire(self) -> int:
        slot = self.free()
        if slot is None:
            raise SlotError(f"all {self.n} staging slots hold a group: finish the oldest before launching another")
        self.states[slot] = SlotState.PACKING
        return slot

    def writable(self, slot: int) -> bool:
        return self.states[slot] is SlotState.PACKING

    def submitted(self, slot: int) -> None:
        if self.states[slot] is not SlotState.PACKING:
            raise SlotError(f"slot {slot} is {self.states[slot].value}, not packing: nothing to submit")
        self.states[slot] = SlotState.QUEUED
        self.launched += 1

    def release(self, slot: int) -> None:
        if self.states[slot] is SlotState.FREE:
            raise SlotError(f"slot {slot} released twice")
        self.states[slot] = SlotState.FREE
