#!/usr/bin/env python3
"""`make demo`: a pool of two workers (on the GPUs when there are any, else on the CPU), a few real
decisions through the Client with their answers and per-call latency, and a clean shutdown.

    laya-pool demo [--model DIR] [--devices cuda:0,cuda:1|cpu] [--calls N]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]          # the checkout, where this runs from one

from laya_pool.client.local import local_pool  # noqa: E402
from laya_pool.protocol import settings  # noqa: E402

DECISIONS = [
    ("The printer on floor 3 is jammed again and the quarterly report is due in an hour.",
     {"team": {"type": "choice", "instructions": "Which team should handle this ticket?",
               "criteria": {"it": "hardware, software, accounts", "facilities": "the building",
                            "finance": "money and reports"}},
      "urgent": {"type": "noul", "instructions": "Does this need attention within the hour?"}}),
    ({"customer": "ACME Corp", "plan": "enterprise", "message": "We were charged twice for March, please fix."},
     {"severity": {"type": "score", "instructions": "How severe is the customer's problem?",
                   "criteria": ["cosmetic", "annoying", "blocking", "business critical"]},
      "refund": {"type": "noul", "instructions": "Is the customer asking for money back?"}}),
    ([{"role": "user", "content": "hi, I want to cancel"},
      {"role": "assistant", "content": "Sorry to hear that. May I ask why?"},
      {"role": "user", "content": "too expensive for what we use"}],
     {"intent": {"type": "choice", "instructions": "What should the agent do next?",
                 "criteria": ["offer a discount", "process the cancellation", "escalate to a human"]}}),
]


def _devices() -> str:
    try:
        import torch
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        n = 0
    if n >= 2:
        return "cuda:0,cuda:1"
    if n == 1:
        return "cuda:0"
    return "cpu"


def _answer_line(qid, a) -> str:
    """An answer in one line: its value (every answer keeps it under its type's name), its confidence, its
    option probabilities when it lists them, and the act head's probability."""
    value = a[a["type"]]
    shown = f"{value:.3f}" if isinstance(value, float) else repr(value)
    probs = ", ".join(f"{k} {v:.3f}" for k, v in (a.get("probabilities") or {}).items())
    return (f"{qid}: {a['type']} {shown}  (confidence {a['confidence']:.3f}{'; ' + probs if probs else ''})  "
            f"act {a['action']['act_probability']:.3f}")


def _default_model() -> Path:
    """checkpoints/tiny in a checkout (`make demo`); installed, the user's cache directory, never site-packages."""
    if (ROOT / "pyproject.toml").is_file():
        return ROOT / "checkpoints" / "tiny"
    cache = Path(settings.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "laya-pool" / "checkpoints" / "tiny"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(_default_model()), help="written there first if missing (%(default)s)")
    p.add_argument("--devices", default=None)
    p.add_argument("--calls", type=int, default=50, help="timed calls per decision after the first")
    a = p.parse_args(argv)
    model = Path(a.model)
    if not (model / "model.safetensors").exists():
        from .make_checkpoint import make_checkpoint
        print(f"writing a tiny checkpoint to {model}")
        make_checkpoint(model, "tiny", 0)
    devices = a.devices or _devices()
    n_dev = len(devices.split(","))
    per_device = 2 if n_dev == 1 else 1
    print(f"starting a pool: {n_dev * per_device} workers on {devices}")
    t = time.perf_counter()
    with local_pool(model, devices, workers_per_device=per_device) as pool:
        print(f"pool ready in {time.perf_counter() - t:.1f} s at {pool.endpoint}")
        with pool.client(timeout=60) as c:
            for w in c.status()["workers"]:
                print(f"  worker {w['id']}: {w['device']} pid {w['pid']} mode {w['mode']} {w['state']}")
            t = time.perf_counter()
            card = c.card()
            print(f"model card from the pool in {(time.perf_counter() - t) * 1e3:.1f} ms "
                  f"(fingerprint {card.fingerprint[:16]}, vocab {card.vocab_size})\n")
            for state, questions in DECISIONS:
                t = time.perf_counter()
                out = c.predict(state, questions)
                first = (time.perf_counter() - t) * 1e3
                lat, workers = [], set()
                for _ in range(a.calls):
                    t = time.perf_counter()
                    c.predict(state, questions)
                    lat.append((time.perf_counter() - t) * 1e3)
                for _ in range(4):
                    workers.add(c.forward(_rows(c, state, questions)).worker)
                shown = state if isinstance(state, str) else str(state)
                print(f"state: {shown[:90]}{'...' if len(shown) > 90 else ''}")
                for qid, ans in out["answers"].items():
                    print(f"  {_answer_line(qid, ans)}")
                lat.sort()
                print(f"  latency per predict(): first {first:.2f} ms, then p50 {statistics.median(lat):.2f} ms, "
                      f"p95 {lat[int(0.95 * (len(lat) - 1))]:.2f} ms over {len(lat)} calls; "
                      f"served by workers {sorted(workers)}\n")
            st = c.status()
            done = {w["id"]: w["completed"] for w in st["workers"]}
            print(f"requests completed per worker: {done}")
        t = time.perf_counter()
    print(f"pool stopped cleanly in {time.perf_counter() - t:.1f} s (exit code {pool.process.returncode})")
    return 0 if pool.process.returncode == 0 else 1


def _rows(c, state, questions):
    from laya_pool.client.semantics import encode_request
    return encode_request(c.card(), state, questions).rows


if __name__ == "__main__":
    sys.exit(main())
