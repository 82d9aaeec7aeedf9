"""A rolling reload (`laya-pool reload --model DIR`): how it goes, and how to read it from the broker's status.

1. The CLI checks DIR, computes its fingerprint and sends RELOAD {model, fingerprint, id} with the operator
   credential. The broker keeps it as `broker.reload` in its status.
2. The supervisor (it polls the status every second) sees a reload id it has not handled: every worker's
   command line now names DIR (so any later start, a crash restart included, loads the new model), and it
   moves the workers one at a time: SIGTERM (the worker finishes what it holds; the broker sends queued
   work elsewhere), start it again on DIR, wait until it has registered with the new fingerprint, next.
3. The broker serves the new fingerprint once at least as many ready workers have it as have the old one
   (broker/table.py `WorkerTable.switch_model`). Before that, new-model workers wait ("mismatch"); after it, the
   old-model workers wait for their turn. A client whose answer carries the new fingerprint fetches the
   new model card and asks again (client/base.py `_predict_plan`), so no request fails and none is
   answered with a card of another model.
4. If the first worker cannot load DIR (exit 78), the supervisor puts the old model back on it and stops
   the reload: the CLI sees that worker register again on the old model and fails with exit 1.

These functions read a status dict (`Client.status()`); pure, so the CLI's tests need no pool.
"""
from __future__ import annotations

from typing import Any

from laya_pool.protocol.contract import WorkerState

_CONNECTED = (WorkerState.READY, WorkerState.MISMATCH, WorkerState.DRAINING)


def all_on(status: dict[str, Any], fingerprint: str) -> bool:
    """Every connected worker is ready on `fingerprint` (and there is at least one)."""
    connected = [w for w in status.get("workers", []) if w.get("state") in _CONNECTED]
    return bool(connected) and all(w.get("state") == WorkerState.READY and w.get("fingerprint") == fingerprint
                                   for w in connected)


def finished(status: dict[str, Any], before: dict[str, dict[str, Any]], fingerprint: str, moved_ids: set[str]) -> bool:
    """The pool serves `fingerprint`, every connected worker is ready on it, and every worker that was
    connected when the reload began has moved (one that is stopped between its turn's stop and start
    is not connected, but has not moved either)."""
    due = {wid for wid, w in before.items() if w.get("state") in _CONNECTED}
    return ((status.get("broker") or {}).get("fingerprint") == fingerprint and all_on(status, fingerprint)
            and due <= moved_ids)


def _restarted(w: dict[str, Any], before: dict[str, dict[str, Any]]) -> bool:
    old = before.get(w.get("id"))
    return old is None or w.get("registrations", 0) > old.get("registrations", 0) or w.get("pid") != old.get("pid")


def moved(status: dict[str, Any], before: dict[str, dict[str, Any]], fingerprint: str) -> dict[str, dict[str, Any]]:
    """The workers that registered again since `before` (rows by id) and serve `fingerprint`."""
    return {w["id"]: w for w in status.get("workers", [])
            if w.get("fingerprint") == fingerprint and w.get("state") in _CONNECTED and _restarted(w, before)}


def problem(status: dict[str, Any], before: dict[str, dict[str, Any]], fingerprint: str,
            reload_id: str | None) -> str | None:
    """Why the reload cannot finish, or None while it can: a worker came back on another model (the
    supervisor rolled it back), or another reload replaced this one."""
    current = (status.get("broker") or {}).get("reload") or {}
    if reload_id and current.get("id") not in (None, reload_id):
        return f"another reload (to {str(current.get('model'))}) replaced this one"
    for w in status.get("workers", []):
        if _restarted(w, before) and w.get("state") in _CONNECTED and w.get("fingerprint") != fingerprint \
                and w.get("id") in before:
            return (f"worker {w['id']} registered again on model {str(w.get('fingerprint'))[:12]}, not "
                    f"{fingerprint[:12]}: the pool could not start it on the new checkpoint and keeps the previous "
                    f"one (the supervisor's log says why)")
    return None
