"""Where a request goes: the one routing policy of the pool, for the broker and for the direct client.

Two places choose a worker for a request: the broker (broker/dispatch.py, for every request it routes) and the
blocking and asyncio clients (client/direct.py, for a first attempt sent straight to a worker). Both choose here,
through `policy()`, from their own table of workers, so they cannot choose differently from the same table.

A policy is pure: it reads a snapshot of each worker (`Candidate`: what it holds in flight, its credit, when it
was last sent a request) and never changes it. Each caller keeps its own facts and says which workers may take the
request (the broker: a ready worker of the pool's model with free credit, large enough for the request; the client:
a route that is up and connected), so a policy is tested alone, from tables (tests/test_routing.py).

A policy chooses a minimum by an order on workers, ties broken by table order: the choice among all the workers
given is then the choice among any subset that holds it. The broker relies on it: it asks once among its free
workers and filters only when that choice cannot take the request (another model, too small).

Policies, by name (`POLICIES`; the pool uses `POLICY`):

- `least_loaded`: the worker with the fewest requests in flight per credit (a worker of credit 4 holding 2 is as
  loaded as one of credit 2 holding 1). A tie goes to the worker sent a request least recently (`last_dispatch`),
  so equally loaded workers take turns; a tie on that too (workers never sent one) to the first in table order
  counted from `start` (the client turns `start` per choice, the broker starts at its first worker).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence, Sized
from typing import Protocol, TypeVar


class Candidate(Protocol):
    """What a policy reads of a worker (the broker's `WorkerInfo`, the client's `Route`)."""
    inflight: Sized             # requests sent to it and not answered yet
    credit: int                 # requests it takes at once (1 where the caller does not know it)
    last_dispatch: float        # when it was last sent a request (time.monotonic(); 0.0: never)


W = TypeVar("W", bound=Candidate)
Policy = Callable[..., "Candidate | None"]      # (workers, start=0, usable=None) -> the chosen one, or None


def least_loaded(workers: Sequence[W], start: int = 0, usable: Callable[[W], bool] | None = None) -> W | None:
    """The usable worker with the fewest requests in flight per credit; ties to the least recently dispatched,
    then to the first from `start` in table order. None when no worker is usable. `usable`: which may take the
    request (default: every one given)."""
    n = len(workers)
    if start % (n or 1):
        at = start % n
        workers = [*workers[at:], *workers[:at]]
    best: W | None = None
    least = 0.0
    for w in workers:
        if usable is not None and not usable(w):
            continue
        load = len(w.inflight) / w.credit
        if best is None or load < least or (load == least and w.last_dispatch < best.last_dispatch):
            best, least = w, load
    return best


POLICIES: dict[str, Policy] = {"least_loaded": least_loaded}
POLICY = "least_loaded"         # the pool's policy: the broker and every client pick by it


def policy(name: str = POLICY) -> Policy:
    """The policy called `name` (default: the pool's)."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"routing policy {name!r}: not one of {', '.join(sorted(POLICIES))}") from None
