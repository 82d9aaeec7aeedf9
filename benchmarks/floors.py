"""What a small forward cannot go below on this card: a kernel's cost in a graph, the weights' streaming time, and
cuBLAS's own products over the same weights.

    python -m benchmarks.floors --model /tmp/large [--rows 48] [--kernels 217] [--samples 30] [--out DIR]

Every figure is a CUDA graph's replay (CUDA events around it, 5 warm-up replays, the median and p95 of --samples):
`kernels`: --kernels tiny kernels in a row (a 1x48 forward is 217), what a kernel boundary costs with no work;
`stream`: one reduction over every product weight of the checkpoint (the embeddings excluded) laid out in one buffer,
the card's rate of reading them; `cublas`: one cuBLAS product per weight at --rows rows, in the order of their names
(what a kernel per product reaches with weights from memory); `hot`: each distinct weight shape's product 50 times
over one weight (L2-resident after the first), a product's own time when memory is not its bound.
"""
from __future__ import annotations

import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.common import parser, write

HOT_REPEATS = 50


def product_shapes(model: str) -> list[tuple[int, int]]:
    """(out, in) of every 2-D weight the forward multiplies by, embeddings excluded, in layer order."""
    from safetensors import safe_open
    with safe_open(str(Path(model) / "model.safetensors"), framework="pt") as f:
        names = [k for k in f.keys() if "emb" not in k and len(f.get_slice(k).get_shape()) == 2]
        order = sorted(names, key=lambda k: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", k)])
        return [tuple(f.get_slice(k).get_shape()) for k in order]


def replay_us(fn: Callable[[], Any], samples: int) -> dict[str, float]:
    """`fn` captured in a CUDA graph; the replay's median and p95 in microseconds."""
    import torch
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    for _ in range(5):
        graph.replay()
    times = []
    for _ in range(samples):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    times.sort()
    return {"p50": round(statistics.median(times), 1), "p95": round(times[int(0.95 * (len(times) - 1))], 1)}


def measure(shapes: list[tuple[int, int]], rows: int, kernels: int, samples: int) -> dict[str, Any]:
    """The four figures (module docstring) for these weight shapes."""
    import torch
    torch.manual_seed(0)
    flat = torch.randn(sum(n * k for n, k in shapes), device="cuda", dtype=torch.bfloat16) * 0.02
    weights, at = [], 0
    for n, k in shapes:
        weights.append(flat[at:at + n * k].view(n, k))
        at += n * k
    xs = {k: torch.randn(rows, k, device="cuda", dtype=torch.bfloat16) for k in {k for _, k in shapes}}
    tiny = torch.zeros(1, device="cuda")

    def empty() -> None:
        for _ in range(kernels):
            tiny.add_(1)

    def products(ws: list[Any]) -> None:
        for w in ws:
            torch.mm(xs[w.shape[1]], w.t())

    result: dict[str, Any] = {"weights_mb": round(flat.numel() * 2 / 1e6, 1), "products": len(shapes), "rows": rows,
                              "kernels": {"count": kernels, **replay_us(empty, samples)},
                              "stream": replay_us(lambda: flat.sum(dtype=torch.float32), samples),
                              "cublas": replay_us(lambda: products(weights), samples), "hot": {}}
    for shape in dict.fromkeys(shapes):
        w = weights[shapes.index(shape)]
        each = replay_us(lambda w=w: products([w] * HOT_REPEATS), samples)
        result["hot"][f"{shape[0]}x{shape[1]}"] = {key: round(v / HOT_REPEATS, 2) for key, v in each.items()}
    return result


def report(r: dict[str, Any]) -> None:
    mb = r["weights_mb"]
    rate = {key: mb / r[key]["p50"] for key in ("stream", "cublas")}           # MB/us = TB/s
    print(f"{r['products']} products, {mb} MB of weights, {r['rows']} rows; graph replay p50 / p95 us")
    print(f"  {r['kernels']['count']} empty kernels   {r['kernels']['p50']:8.1f} / {r['kernels']['p95']:.1f}"
          f"   ({r['kernels']['p50'] / r['kernels']['count']:.2f} a kernel)")
    print(f"  one pass over the weights {r['stream']['p50']:8.1f} / {r['stream']['p95']:.1f}"
          f"   ({rate['stream']:.2f} TB/s)")
    print(f"  a cuBLAS product each    {r['cublas']['p50']:8.1f} / {r['cublas']['p95']:.1f}"
          f"   ({rate['cublas']:.2f} TB/s)")
    for shape, each in r["hot"].items():
        print(f"  one {shape} product, L2-resident weight  {each['p50']:6.2f} / {each['p95']:.2f}")
    floor = r["kernels"]["p50"] + r["stream"]["p50"]
    print(f"  a forward of {r['kernels']['count']} kernels reading these weights: >= ~{floor:.0f} us "
          "(its boundaries plus one pass, nothing overlapped)")


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--model", required=True, help="checkpoint directory (its weight shapes)")
    ap.add_argument("--rows", type=int, default=48, help="rows of each product (tokens of the forward)")
    ap.add_argument("--kernels", type=int, default=217, help="empty kernels in a row (a 1x48 forward's count)")
    ap.add_argument("--samples", type=int, default=30, help="timed replays a figure")
    args = ap.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("floors: needs a CUDA device", file=sys.stderr)
        return 2
    result = measure(product_shapes(args.model), args.rows, args.kernels, args.samples)
    result["device"] = torch.cuda.get_device_name()
    report(result)
    write(args.out, "floors", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
