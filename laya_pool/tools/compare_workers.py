#!/usr/bin/env python3
"""Check every worker of a pool, in every execution mode, against each other and against the reference.

    laya-pool compare-workers --frontend ENDPOINT --report FILE [--model DIR]
    laya-pool compare-workers --model DIR --report FILE          # starts its own 2-worker pool

The same frozen cases (the committed request cases plus shape cases from 1x48 to 16x512, bucket edges
and a changed-input A->B->A sequence) go through every live worker, targeted by id through the broker,
in every mode it runs (eager, graph-fixed, graph-cached), in forward and then reverse order. Checks:
  - one worker, one mode: both orders byte-identical (replays see new inputs; first calls included);
  - one worker: every mode byte-identical to its eager output;
  - workers in the same mode and dtype: byte-identical to each other;
  - each worker against the reference (the official SDK when installed, else our fp32 reference
    forward): max |d logit| and max |d p| within the dtype's tolerance, and eager taps against the
    reference's taps by nRMS; the first diverging tap is named.
Prints a table, writes a JSON report, exits 0 only if everything agrees.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np

CASES = Path(__file__).resolve().parent / "cases" / "requests.json"
from laya_pool.protocol.contract import MODES  # noqa: E402
from laya_pool.protocol.qtypes import QUESTION_TYPES  # noqa: E402

from .progress import Progress, enabled  # noqa: E402

# Stated tolerances against the fp32 reference, per worker dtype: probabilities, and taps by nRMS.
TOL = {"fp32": {"dp": 1e-4, "nrms": 1e-4}, "bf16": {"dp": 0.06, "nrms": 0.05}}
TAP_ORDER = ["embeddings"]


def frozen_cases(card) -> list[tuple[str, list]]:
    from laya_pool.client.semantics import encode_request
    cases = json.loads(CASES.read_text())["cases"]
    out = [(c["name"], encode_request(card, c["state"], c["questions"]).rows) for c in cases]
    rng = np.random.default_rng(0)
    top = min(card.vocab_size, 1000)

    def rows(n, length, k, seed):
        r = np.random.default_rng(seed)
        return [(r.integers(5, top, length).astype(np.int32),
                 np.sort(r.choice(np.arange(1, length), k, replace=False)).astype(np.int32), i % len(QUESTION_TYPES))
                for i in range(n)]
    for n, length, k in ((1, 48, 4), (1, 128, 4), (4, 256, 6), (16, 512, 8), (4, 64, 2), (5, 64, 2), (4, 65, 3)):
        out.append((f"shape {n}x{length}", rows(n, length, k, int(rng.integers(1 << 30)))))
    a, b = rows(2, 60, 3, 11), rows(2, 60, 3, 12)
    out += [("A", a), ("B", b), ("A again", a)]
    return out


def nrms(x: np.ndarray, ref: np.ndarray) -> float:
    den = float(np.sqrt(np.mean(ref.astype(np.float64) ** 2))) or 1.0
    return float(np.sqrt(np.mean((x.astype(np.float64) - ref) ** 2))) / den


def softmax_rows(logits: np.ndarray, counts: list[int]) -> list[np.ndarray]:
    out, o = [], 0
    for k in counts:
        z = logits[o: o + k].astype(np.float64)
        e = np.exp(z - z.max())
        out.append(e / e.sum())
        o += k
    return out


class Reference:
    """Final outputs from the SDK when it is installed (else our fp32 reference); taps from ours."""

    def __init__(self, model_dir: str):
        import torch

        from laya_pool.kernels.reference import ReferenceModel
        from laya_pool.worker.checkpoint import load_checkpoint
        ck = load_checkpoint(model_dir)
        self.ours = ReferenceModel(ck.arch, ck.tensors, device="cpu", dtype=torch.float32)
        self.sdk = None
        self.name = "our fp32 reference"
        try:
            import warnings

            import laya
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                self.sdk = laya.load(model_dir, device="cpu")
            self.name = "official SDK (fp32, cpu)"
        except ImportError:
            pass

    def run(self, rows) -> tuple[np.ndarray, np.ndarray, dict]:
        import torch
        lengths = [len(r[0]) for r in rows]
        k = max(len(r[1]) for r in rows)
        markers = torch.full((len(rows), k), -1, dtype=torch.int64)
        for i, r in enumerate(rows):
            markers[i, : len(r[1])] = torch.as_tensor(r[1])
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        taps: dict = {}
        logits, act = self.ours.forward(torch.as_tensor(np.concatenate([r[0] for r in rows])),
                                        torch.as_tensor(starts), torch.as_tensor(lengths),
                                        torch.as_tensor([r[2] for r in rows]), markers, max(lengths), taps=taps)
        flat = np.concatenate([logits[i, : len(r[1])].numpy() for i, r in enumerate(rows)])
        act = act.numpy()
        if self.sdk is not None:
            from laya.common import collate_items
            items = [{"ids": r[0].tolist(), "markers": r[1].tolist(), "qtype": int(r[2])} for r in rows]
            with torch.no_grad():
                sl, sa = self.sdk._forward(collate_items([items], self.sdk.tok.pad_token_id))
            flat = np.concatenate([sl[i, : len(r[1])] for i, r in enumerate(rows)]).astype(np.float32)
            act = sa.astype(np.float32)
        return flat, act, {name: t.numpy() for name, t in taps.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--frontend", default=None)
    ap.add_argument("--model", default=None, help="checkpoint for the reference (and for a pool of our own)")
    ap.add_argument("--report", default="out/compare_workers.json")
    ap.add_argument("--devices", default=None, help="for a pool of our own: cpu or cuda:0,...")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a TTY)")
    args = ap.parse_args(argv)
    if not args.frontend and not args.model:
        ap.error("give --frontend, --model, or both")
    from laya_pool.client.errors import RequestFailed
    from laya_pool.client.local import local_pool
    from laya_pool.client.pool import Client

    with contextlib.ExitStack() as stack:
        if not args.frontend:
            import torch
            devices = args.devices or ("cuda:0" if torch.cuda.is_available() else "cpu")
            args.frontend = stack.enter_context(local_pool(args.model, devices=devices, workers_per_device=2)).endpoint
        return compare(args, Client, RequestFailed)


def compare(args, Client, RequestFailed) -> int:
    client = Client(args.frontend, timeout=args.timeout)
    card = client.card()
    workers = [w for w in client.status()["workers"] if w["state"] in ("ready", "mismatch")]
    cases = frozen_cases(card)
    fingerprints = {w["id"]: w["fingerprint"] for w in workers}
    ref = Reference(args.model) if args.model else None
    print(f"{len(workers)} workers, {len(cases)} cases, reference: {ref.name if ref else 'none (no --model)'}",
          flush=True)
    outputs, taps = _run_cases(client, workers, cases, ref is not None, RequestFailed,
                               enabled(getattr(args, "quiet", False)))
    refs = [ref.run(rows) for _, rows in cases] if ref else None
    rows_out, failures = [], []
    for (wid, dtype, mode, order), outs in outputs.items():
        if order != "forward":
            continue
        row = _verdict(wid, dtype, mode, outs, outputs, fingerprints, card.fingerprint)
        if refs is not None:
            _against_reference(row, outs, cases, refs, taps[wid])
        row["ok"] = not row["notes"]
        if not row["ok"]:
            failures.append(f"worker {wid} ({mode}): " + "; ".join(row["notes"]))
        rows_out.append(row)
    print(f"\n{'worker':10} {'dtype':5} {'mode':13} {'max|dlogit|':>11} {'max|dp|':>9} {'max|dact|':>9}  verdict")
    for r in rows_out:
        print(f"{r['worker']:10} {r['dtype']:5} {r['mode']:13} {r.get('max_dlogit', float('nan')):11.3g} "
              f"{r.get('max_dp', float('nan')):9.3g} {r.get('max_dact', float('nan')):9.3g}  "
              f"{'OK' if r['ok'] else 'MISMATCH: ' + '; '.join(r['notes'])}")
    report = {"frontend": args.frontend, "reference": ref.name if ref else None, "cases": [n for n, _ in cases],
              "tolerances": TOL, "results": rows_out, "failures": failures,
              "workers": [{k: w[k] for k in ("id", "device", "state", "fingerprint")} for w in workers]}
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    Path(args.report).write_text(json.dumps(report, indent=2))
    print("compare_workers:", "OK, every worker agrees" if not failures else f"{len(failures)} mismatches")
    return 1 if failures else 0


def _run_cases(client, workers: list[dict], cases, with_taps: bool, RequestFailed, progress: bool) -> tuple[dict, dict]:
    """Every case on every worker in every mode it runs, in forward and reverse order: ({(worker, dtype, mode,
    order): [(logits, act, first_call)] in case order}, {worker: its eager taps per case} when `with_taps`)."""
    outputs: dict = {}          # (worker, mode, order) -> list of (logits, act)
    taps: dict = {}
    bar = Progress(len(workers) * len(MODES) * 2 * len(cases), "compare", progress)
    for w in workers:
        dtype = "fp32" if w["device"] == "cpu" else "bf16"
        for mode in MODES:
            for order in ("forward", "reverse"):
                idx = list(range(len(cases)))[:: 1 if order == "forward" else -1]
                got = {}
                try:
                    for i in idx:
                        res = client.forward(cases[i][1], worker=w["id"], mode=mode)
                        got[i] = (res.flat, res.act, res.metrics.get("first_call", False))
                        bar.update()
                except RequestFailed as e:
                    if e.field == "mode":
                        break           # this worker does not run this mode (a CPU worker: eager only)
                    raise
                outputs[(w["id"], dtype, mode, order)] = [got[i] for i in range(len(cases))]
            bar.close()
            print(f"  {w['id']} {mode}: {'done' if (w['id'], dtype, mode, 'forward') in outputs else 'n/a'}",
                  flush=True)
        if with_taps:
            taps[w["id"]] = [client.forward(rows, worker=w["id"], mode="eager", taps=True).taps
                             for _, rows in cases]
    return outputs, taps


def _verdict(wid: str, dtype: str, mode: str, outs: list, outputs: dict, fingerprints: dict, pool_fp: str) -> dict:
    """A worker's row in one mode: its answers against its reverse order, its own eager answers and its peers'."""
    row = {"worker": wid, "dtype": dtype, "mode": mode, "ok": True, "notes": []}
    rev = outputs[(wid, dtype, mode, "reverse")]
    if any(not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])) for a, b in zip(outs, rev)):
        row["notes"].append("forward and reverse order differ")
    eager = outputs.get((wid, dtype, "eager", "forward"))
    if eager is not None and any(not np.array_equal(a[0], b[0]) for a, b in zip(outs, eager)):
        row["notes"].append("differs from its own eager output")
    # Byte-identity is asked of workers serving the same model; one serving another model is
    # reported for that, and against the reference, not held against the healthy ones.
    fp = fingerprints[wid]
    if fp != pool_fp:
        row["notes"].append(f"serves model {fp[:12]}, the pool serves {pool_fp[:12]}")
    peers = [k for k in outputs if k[1] == dtype and k[2] == mode and k[3] == "forward" and k[0] != wid
             and fingerprints[k[0]] == fp]
    for peer in peers:
        if any(not (np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]))
               for a, b in zip(outs, outputs[peer])):
            row["notes"].append(f"differs from worker {peer[0]}")
    return row


def _against_reference(row: dict, outs: list, cases, refs: list, worker_taps: list) -> None:
    """The row's distance from the reference (max |d logit|, |d p|, |d act|), a note past the dtype's tolerance."""
    dtype = row["dtype"]
    dl = max(float(np.abs(o[0] - r[0]).max()) for o, r in zip(outs, refs))
    dp = 0.0
    for (_, rows), o, r in zip(cases, outs, refs):
        counts = [len(x[1]) for x in rows]
        dp = max(dp, max(float(np.abs(a - b).max()) for a, b in
                         zip(softmax_rows(o[0], counts), softmax_rows(r[0], counts))))
    da = max(float(np.abs(o[1] - r[1]).max()) for o, r in zip(outs, refs))
    row.update(max_dlogit=dl, max_dp=dp, max_dact=da)
    if dp > TOL[dtype]["dp"] or da > TOL[dtype]["dp"]:
        row["notes"].append(f"against the reference: max|dp| {dp:.3g}, max|d act| {da:.3g} "
                            f"over the {dtype} tolerance {TOL[dtype]['dp']}")
        first = first_divergence(worker_taps, cases, refs, TOL[dtype]["nrms"])
        if first:
            row["notes"].append(f"first diverging tap: {first}")


def first_divergence(worker_taps: list[dict], cases, refs, tol: float) -> str | None:
    """The earliest tap (in forward order) whose nRMS against the reference exceeds `tol`, over valid tokens."""
    names = list(refs[0][2])
    for name in names:
        for (case, rows), wt, (_, _, rt) in zip(cases, worker_taps, refs):
            if name not in wt:
                continue
            a, b = np.asarray(wt[name]), rt[name]
            if a.ndim == 3:
                mask = np.arange(a.shape[1])[None, :] < np.array([len(r[0]) for r in rows])[:, None]
                a, b = a[mask], b[mask]
            if nrms(a, b) > tol:
                return f"{name} (case {case!r}, nRMS {nrms(a, b):.3g})"
    return None


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:                      # exit 1 means "workers disagree"; a crash must not look like that
        import traceback
        traceback.print_exc()
        sys.exit(2)
