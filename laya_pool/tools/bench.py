#!/usr/bin/env python3
"""Warm latency per request shape and configuration, with the official SDK measured in the same run.

    laya-pool bench --model DIR [--device cuda] [--frontend tcp://127.0.0.1:5555] [--out DIR] [--quick]

Protocol: an excluded feasibility pass first (one call per shape and configuration, which is also where
each configuration's first-call cost is recorded, capture included); then two rounds, the second in the
opposite configuration order, each with 10 warm-up calls and 50 timed calls per shape and configuration.
The clock is the host's, around the whole call: validation, packing, upload, execution, synchronisation
and readback (and for the *predict* configurations, tokenization and decoding too). Reported: p50, p95 and
min over both rounds. Writes bench.json, bench.png and bench.md under --out and prints the table last.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from .progress import Progress, enabled  # noqa: E402

SDK_GRAPH = "sdk forward cuda-graph"
SHAPES = [(1, 48), (1, 128), (4, 256), (16, 512)]
MIXED = [(1, 48), (2, 96), (4, 256), (1, 400), (8, 160)]
WORDS = ("ticket customer refund invoice urgent billing account password reset login error crash payment card "
         "declined shipping delayed order package lost damaged return exchange warranty support").split()

# What a request's questions cycle through: (type, criteria) of a 4-way choice, a noul, a 3-level score.
_QUESTIONS = (("choice", {"billing": "", "tech": "", "sales": "", "legal": ""}), ("noul", None),
              ("score", ["none", "low", "high"]))


def make_request(card, rows: int, length: int) -> tuple[str, dict]:
    """A predict() call whose encoding has `rows` rows of (at most, and as near as possible) `length` tokens."""
    from laya_pool.client.semantics import encode_request

    questions = {}
    for i in range(rows):
        kind, criteria = _QUESTIONS[i % len(_QUESTIONS)]
        q = {"type": kind, "instructions": f"Question {i}: is the {WORDS[i % len(WORDS)]} handled?"}
        if criteria is not None:
            q["criteria"] = criteria
        questions[f"q{i}"] = q

    def longest(n_words: int) -> int:
        state = " ".join(WORDS[j % len(WORDS)] for j in range(n_words))
        return max(len(r[0]) for r in encode_request(card, state, questions).rows)

    lo, hi = 0, 4 * length
    while lo < hi:                      # the largest word count whose longest row still fits in `length`
        mid = (lo + hi + 1) // 2
        if longest(mid) <= length:
            lo = mid
        else:
            hi = mid - 1
    return " ".join(WORDS[j % len(WORDS)] for j in range(lo)), questions


def percentiles(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"p50": statistics.median(s), "p95": s[min(len(s) - 1, int(round(0.95 * (len(s) - 1))))],
            "min": s[0], "n": len(s)}


def sdk_graph_forward(agent, enc, device):
    """The SDK's own model forward, captured in one CUDA graph over a padded batch (its best case)."""
    import torch
    from laya.common import collate_items

    items = [{"ids": ids.tolist(), "markers": mk.tolist(), "qtype": qt} for ids, mk, qt in enc.rows]
    b = collate_items([items], agent.tok.pad_token_id)
    static = [b[k].to(device) for k in ("input_ids", "attention_mask", "marker_pos", "marker_mask", "qtype")]
    model = agent.model

    def fwd():
        # No autocast weight cache: cached casts made outside the capture must not be read inside it.
        with torch.autocast("cuda", dtype=agent.dtype, cache_enabled=False):
            return model(*static)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s), torch.no_grad():
        for _ in range(3):
            fwd()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.no_grad(), torch.cuda.graph(g):
        out = fwd()

    def call():
        g.replay()
        return out[0].float().cpu(), out[1].float().cpu()
    return call


def build_configs(args, card, requests) -> dict[str, Callable[[int], Callable[[], object]]]:
    """name -> (shape index -> a zero-argument call). Each factory is built once per configuration."""
    from laya_pool.client.decode import decode_answers
    from laya_pool.client.semantics import encode_request
    from laya_pool.worker.batch import Batch
    from laya_pool.worker.checkpoint import load_checkpoint
    from laya_pool.worker.runtime import Runtime, RuntimeConfig
    from laya_pool.worker.workspace import Capacity

    ck = load_checkpoint(args.model)
    cap = Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=64)
    cuda = args.device.startswith("cuda")
    modes = ["eager", "graph-fixed", "graph-cached"] if cuda else ["eager"]
    configs: dict[str, Callable] = {}
    encoded = [encode_request(card, s, q) for s, q in requests]
    batches = [Batch.from_rows(e.rows) for e in encoded]
    def runtime_config(rt):
        return lambda i: (lambda: rt.run(batches[i]))
    for mode in modes:
        configs[f"ours {mode}"] = runtime_config(Runtime(ck, device=args.device,
                                                         config=RuntimeConfig(mode=mode, capacity=cap)))
    rt_best = Runtime(ck, device=args.device, config=RuntimeConfig(mode=modes[-1], capacity=cap))

    def ours_predict(i):
        state, questions = requests[i]

        def call():
            enc = encode_request(card, state, questions)
            res = rt_best.run(Batch.from_rows(enc.rows))
            return decode_answers(card, enc, res.logits, res.act)
        return call
    configs[f"ours predict ({modes[-1]})"] = ours_predict
    if not args.no_sdk:
        import laya
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            agent = laya.load(args.model, device=args.device)
        configs["sdk predict"] = lambda i: (lambda: agent.predict(*requests[i]))
        if cuda:
            configs[SDK_GRAPH] = lambda i: sdk_graph_forward(agent, encoded[i], args.device)
    if args.only:
        configs = {k: v for k, v in configs.items() if k == args.only}
    elif cuda:
        configs.pop(SDK_GRAPH, None)     # measured in a child process: see run_child
    if args.frontend:
        from laya_pool.client.pool import Client
        client = Client(args.frontend)
        configs["pool client.predict"] = lambda i: (lambda: client.predict(*requests[i]))
    return configs


def run(args) -> dict:
    import torch

    from laya_pool.client.card import ModelCard

    card = ModelCard.from_dir(args.model)
    shapes = SHAPES[:2] if args.quick else SHAPES
    labels = [f"{r}x{n}" for r, n in shapes] + ["mixed"]
    requests = [make_request(card, r, n) for r, n in shapes] + [make_request(card, r, n) for r, n in MIXED]
    configs = build_configs(args, card, requests)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    n_fixed = len(shapes)

    def calls_for(factory):
        fixed = [factory(i) for i in range(n_fixed)]
        mixed = [factory(n_fixed + j) for j in range(len(MIXED))]
        return fixed + [mixed]

    first_call, results, prepared = {}, {name: {lab: [] for lab in labels} for name in configs}, {}
    for name, factory in configs.items():                  # feasibility pass (excluded), first-call cost
        prepared[name] = calls_for(factory)
        first_call[name] = {}
        for lab, call in zip(labels, prepared[name]):
            seq = call if isinstance(call, list) else [call]
            t = time.perf_counter()
            for c in seq:
                c()
            sync()
            first_call[name][lab] = (time.perf_counter() - t) * 1e3 / len(seq)
        print(f"feasible: {name}  first call ms: " + ", ".join(f"{k} {v:.2f}" for k, v in first_call[name].items()),
              flush=True)
    order = list(configs)
    bar = Progress(2 * len(labels) * len(order) * (args.warmup + args.samples), "bench", enabled(args.quiet))
    for rnd, names in enumerate((order, order[::-1])):
        for lab_i, lab in enumerate(labels):
            for name in names:
                call = prepared[name][lab_i]
                seq = call if isinstance(call, list) else [call]
                for j in range(args.warmup):
                    seq[j % len(seq)]()
                    bar.update()
                for j in range(args.samples):
                    c = seq[j % len(seq)]
                    t = time.perf_counter()
                    c()
                    sync()
                    results[name][lab].append((time.perf_counter() - t) * 1e3)
                    bar.update()
        bar.close()
        print(f"round {rnd + 1} done", flush=True)
    dev = torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu"
    table = {name: {lab: percentiles(xs) for lab, xs in per.items()} for name, per in results.items()}
    return {"device": dev, "model": str(args.model), "date": time.strftime("%Y-%m-%d"), "shapes": labels,
            "warmup": args.warmup, "samples_per_round": args.samples, "rounds": 2, "first_call_ms": first_call,
            "latency_ms": table}


def run_child(args, report: dict) -> None:
    """The SDK's forward in a CUDA graph, timed by the same protocol in a child process.

    Capturing a model we do not own can fail in ways that poison the CUDA context (a device-side
    assert), so it runs apart and a failure costs only its own row.
    """
    import os
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", __spec__.name, "--model", str(args.model), "--device", args.device,
               "--only", SDK_GRAPH, "--out", tmp, "--warmup", str(args.warmup), "--samples", str(args.samples)]
        if args.quick:
            cmd.append("--quick")
        # the child imports this package from where this process found it (a checkout or an install)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            report.setdefault("failed", {})[SDK_GRAPH] = proc.stderr.strip().splitlines()[-1:] or ["no output"]
            print(f"{SDK_GRAPH}: failed: {report['failed'][SDK_GRAPH]}", flush=True)
            return
        child = json.loads((Path(tmp) / "bench.json").read_text())
    report["latency_ms"].update(child["latency_ms"])
    report["first_call_ms"].update(child["first_call_ms"])


def markdown(report: dict) -> str:
    labs = report["shapes"]
    lines = [f"Card: {report['device']}; {report['date']}; model {Path(report['model']).name}; "
             f"{report['warmup']} warm-ups + {report['samples_per_round']} samples x 2 rounds (opposite orders); "
             "ms, p50 / p95 (min)", "", "| configuration | " + " | ".join(labs) + " |",
             "| --- |" + " --- |" * len(labs)]
    for name, why in report.get("failed", {}).items():
        lines.append(f"| {name} | failed: {' '.join(why)} |" + " |" * (len(labs) - 1))
    for name, per in report["latency_ms"].items():
        cells = [f"{per[lab]['p50']:.3f} / {per[lab]['p95']:.3f} ({per[lab]['min']:.3f})" for lab in labs]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += ["", "First call (capture included), ms:", "", "| configuration | " + " | ".join(labs) + " |",
              "| --- |" + " --- |" * len(labs)]
    for name, per in report["first_call_ms"].items():
        lines.append(f"| {name} | " + " | ".join(f"{per[lab]:.2f}" for lab in labs) + " |")
    return "\n".join(lines) + "\n"


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labs = report["shapes"]
    fig, ax = plt.subplots(figsize=(8, 5))
    for name, per in report["latency_ms"].items():
        ax.plot(labs, [per[lab]["p50"] for lab in labs], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("request shape (rows x tokens)")
    ax.set_ylabel("p50 latency, ms (log)")
    ax.set_title(f"laya-pool vs the official SDK on {report['device']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--device", default=None)
    ap.add_argument("--frontend", default=None, help="also time Client.predict end to end through this pool")
    ap.add_argument("--out", default="out/bench")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--samples", type=int, default=50)
    ap.add_argument("--quick", action="store_true", help="two shapes, for CI on a CPU")
    ap.add_argument("--no-sdk", action="store_true")
    ap.add_argument("--only", default=None, help="time one configuration only (used for the SDK graph child)")
    ap.add_argument("--quiet", action="store_true", help="no progress bar (there is none when stderr is not a TTY)")
    args = ap.parse_args(argv)
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = run(args)
    if args.device.startswith("cuda") and not args.only and not args.no_sdk:
        run_child(args, report)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(report, indent=2))
    md = markdown(report)
    (out / "bench.md").write_text(md)
    plot(report, out / "bench.png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
