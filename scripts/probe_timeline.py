#!/usr/bin/env python3
"""Device probe: where a graph-replayed forward's time goes, kernel by kernel, as the GPU ran it.

    PYTHONPATH=$PWD python3 scripts/probe_timeline.py --model /tmp/large [--shapes 1x48,32x48,16x512] [--out DIR]

torch.profiler's per-family sums (probe_fast.py `model`, scripts/profile_forward.py) time an eager forward, whose
kernels run apart; in a replay under programmatic dependent launch (kernels/launch.py) each kernel starts before the
one ahead of it ends and waits inside (griddepcontrol.wait), so its own duration says little. What a kernel costs the
forward is how far it moves the end of the work: `extends` = its end minus the latest end before it (0 if it ends
inside an earlier kernel), and `idle` = the time nothing ran before it started. Both sum to the span of the replay.

Kernels are labelled by family (the Triton function's name) and, for the encoder's GEMMs, by their place in a layer:
the GEMM before an attention is QKV, the one after it Wo, a GEMM followed by a GEMM is Wi (GeGLU), one following a
GEMM is Wo_mlp (the decision head's four take the same labels); every GEMM after the scorer's gather is "gemm tail".
One forward is captured into a CUDA graph with `probe_fast.capture`; five replays are profiled and the middle
one is reported (their spans too). The profiler's trace goes to DIR/trace[-TAG]-RxL.json, the table and the middle
replay's kernels to DIR/timeline[-TAG]-RxL.json; `--tag` also keeps each shape's answers, to compare two trees' bits.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..")]

from scripts.probe_fast import _family, _inputs, capture  # noqa: E402

REPLAYS = 5


def kernels(trace_path: str) -> list[dict]:
    """Kernel events of a chrome trace, sorted by start: name, start and end in us, grid."""
    with open(trace_path) as f:
        events = json.load(f)["traceEvents"]
    out = [dict(name=e["name"], start=float(e["ts"]), end=float(e["ts"]) + float(e.get("dur", 0)),
                grid=tuple(e.get("args", {}).get("grid", ())))
           for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    return sorted(out, key=lambda k: k["start"])


def labels(ks: list[dict]) -> list[str]:
    """Each kernel's family, GEMMs named by their place in a layer (module docstring)."""
    fams = [_family(k["name"]) for k in ks]
    out = []
    tail = False
    for i, f in enumerate(fams):
        tail = tail or f == "gather_norm_kernel"       # the scorer and the act head: their GEMMs are no layer's
        if f != "gemm_kernel":
            out.append(f)
            continue
        prev = fams[i - 1] if i else ""
        nxt = fams[i + 1] if i + 1 < len(fams) else ""
        if tail:
            out.append("gemm tail")
        elif nxt == "attention_kernel":
            out.append("gemm qkv")
        elif prev == "attention_kernel":
            out.append("gemm wo")
        elif nxt == "gemm_kernel" and prev != "gemm_kernel":
            out.append("gemm wi")
        elif prev == "gemm_kernel" and out[-1] == "gemm wi":
            out.append("gemm wo_mlp")
        else:
            out.append("gemm other")
    return out


def account(ks: list[dict]) -> dict:
    """Per label: count, summed duration, how far its kernels moved the end of the work, idle time before them."""
    rows = collections.defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    latest = ks[0]["start"]
    for k, lab in zip(ks, labels(ks)):
        r = rows[lab]
        r[0] += 1
        r[1] += k["end"] - k["start"]
        r[2] += max(0.0, k["end"] - max(latest, k["start"]))
        r[3] += max(0.0, k["start"] - latest)
        latest = max(latest, k["end"])
    return {lab: dict(count=r[0], dur_us=round(r[1], 2), extends_us=round(r[2], 2), idle_us=round(r[3], 2))
            for lab, r in sorted(rows.items(), key=lambda kv: -(kv[1][2] + kv[1][3]))}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="/tmp/large")
    p.add_argument("--shapes", default="1x48,32x48,4x256,16x512")
    p.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    p.add_argument("--tag", default="", help="names the files; with it, each shape's answers are kept "
                   "(answers-TAG-RxL.pt: logits and act probabilities) so two trees' bits can be compared")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    from laya_pool.kernels.fast import FastModel
    from laya_pool.worker.checkpoint import load_checkpoint
    ck = load_checkpoint(args.model)
    fast = FastModel(ck.arch, ck.tensors, device="cuda", attention="triton")
    for shape in args.shapes.split(","):
        R, L = (int(x) for x in shape.split("x"))
        inp = _inputs(ck.arch, R, L)
        if args.tag:
            torch.save([t.cpu() for t in fast(**inp)], os.path.join(args.out, f"answers-{args.tag}-{shape}.pt"))
        g = capture(lambda inp=inp: fast(**inp))
        name = f"{'-' + args.tag if args.tag else ''}-{shape}.json"
        path = os.path.join(args.out, "trace" + name)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(REPLAYS):
                g.replay()
            torch.cuda.synchronize()
        prof.export_chrome_trace(path)
        ks = kernels(path)
        if not ks or len(ks) % REPLAYS:
            print(f"{shape}: {len(ks)} kernel events for {REPLAYS} replays: cannot split them")
            continue
        n = len(ks) // REPLAYS
        spans = [ks[i * n + n - 1]["end"] - ks[i * n]["start"] for i in range(REPLAYS)]
        mid = ks[(REPLAYS // 2) * n:(REPLAYS // 2 + 1) * n]
        table = account(mid)
        print(f"\n== {shape}: {n} kernels a replay; span us {' '.join(f'{s:.1f}' for s in spans)} "
              f"(median {statistics.median(spans):.1f}); the middle replay by label:")
        head = ("label", "n", "extends us", "idle us", "sum dur us", "us / kernel")
        print("   {:24s} {:>4s} {:>11s} {:>8s} {:>11s} {:>11s}".format(*head))
        for lab, r in table.items():
            per = (r["extends_us"] + r["idle_us"]) / r["count"]
            print(f"   {lab:24s} {r['count']:4d} {r['extends_us']:11.1f} {r['idle_us']:8.1f} {r['dur_us']:11.1f} "
                  f"{per:11.2f}")
        with open(os.path.join(args.out, "timeline" + name), "w") as f:
            json.dump(dict(shape=shape, spans_us=spans, table=table, kernels=mid), f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
