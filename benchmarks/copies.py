"""What a group's copies cost: one copy each way (the worker's layout) against two each way, same sizes otherwise.

    python -m benchmarks.copies [--groups 5000] [--out DIR]        # on a CUDA host

A 1x48 group uploads ~0.4 KB of fields and reads ~0.1 KB of answers back. Two up and two back is how a slot laid out
with the ids apart from the row fields, and answers in two buffers, goes; one each way is the worker's layout
(worker/workspace.py: the fields with the ids last, so the one span also carries the markers past the shape's, 33.7 KB
at the default capacity; the logits and act adjacent). Each group is queued on an idle stream, as at one request at a
time, and followed by a done event, the variants alternating; printed: the host's time to queue a group (p50, p95)
and the stream's time for it (p50, between two timing events). docs/decisions/0029-one-copy-each-way.md.
"""
from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from benchmarks.common import parser, write

UP = (4 * 48, 4 * 52)          # ids, then the row fields and markers (bytes)
BACK = (16, 16)                # logits, act


def one_up(tokens: int = 48) -> int:
    """Bytes of the worker's one upload of a `tokens`-token group at the default capacity: the slot's start (the
    fields, the markers' whole capacity) to its last token."""
    import torch

    from laya_pool.worker.workspace import Capacity, Workspace
    return 4 * (Workspace(Capacity(), 4, torch.device("cpu")).offsets["ids"] + tokens)


def variants(ptrs: tuple[int, int], stream: int, event: Any) -> dict[str, Callable[[], None]]:
    from laya_pool.worker.cudart import memcpy_async
    host, dev = ptrs
    up = one_up()

    def apart() -> None:
        memcpy_async(dev, host, UP[0], True, stream)
        memcpy_async(dev + 65536, host + 65536, UP[1], True, stream)
        memcpy_async(host + 500000, dev + 300000, BACK[0], False, stream)
        memcpy_async(host + 510000, dev + 310000, BACK[1], False, stream)
        event.record(stream)

    def together() -> None:
        memcpy_async(dev, host, up, True, stream)
        memcpy_async(host + 500000, dev + 300000, sum(BACK) + 48, False, stream)
        event.record(stream)
    return {"two up, two back": apart, "one up, one back": together}


def main(argv: list[str] | None = None) -> int:
    ap = parser(__doc__)
    ap.add_argument("--groups", type=int, default=5000, help="timed groups of each variant")
    args = ap.parse_args(argv)
    import torch

    from laya_pool.worker.cudart import Event, PinnedBuffer, stream_synchronize
    torch.zeros(1, device="cuda")
    s = torch.cuda.Stream()
    pinned, dev = PinnedBuffer(1 << 20), torch.empty(1 << 18, dtype=torch.int32, device="cuda")
    kinds = variants((pinned.ptr, dev.data_ptr()), s.cuda_stream, Event())
    host: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(2 * (args.groups + 500)):
        name = list(kinds)[i % 2]
        stream_synchronize(s.cuda_stream)
        t = time.perf_counter()
        kinds[name]()
        dt = time.perf_counter() - t
        stream_synchronize(s.cuda_stream)
        if i >= 1000:
            host[name].append(dt * 1e6)
    result: dict[str, Any] = {}
    for name, fn in kinds.items():
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        device = []
        for _ in range(500):
            stream_synchronize(s.cuda_stream)
            a.record(s)
            fn()
            b.record(s)
            b.synchronize()
            device.append(a.elapsed_time(b) * 1e3)
        h = sorted(host[name])
        result[name] = {"host_us_p50": round(statistics.median(h), 2), "host_us_p95": round(h[int(0.95 * len(h))], 2),
                        "device_us_p50": round(statistics.median(device), 2)}
        print(f"{name}: host p50 {result[name]['host_us_p50']:.1f} us, p95 {result[name]['host_us_p95']:.1f}; "
              f"stream p50 {result[name]['device_us_p50']:.1f} us", flush=True)
    pinned.close()
    write(args.out, "copies", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
