#!/usr/bin/env python3
"""Device debug: tests/test_runtime_gpu.py's first test as a plain script (same order, nothing before it).

On an upload failure it prints what the CUDA runtime knows about the pointers and the thread's context,
and retries the copy from other staging buffers, so the failing party can be named.
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_runtime_gpu import CAP, frozen_batches  # noqa: E402

from worker.checkpoint import load_checkpoint  # noqa: E402
from worker.runtime import Runtime, RuntimeConfig  # noqa: E402


def diagnose(rts):
    from cuda.bindings import driver as drv
    from cuda.bindings import runtime as rt

    from worker.cudart import PinnedBuffer
    print("ctx current", drv.cuCtxGetCurrent(), "device", rt.cudaGetDevice(), "last error", rt.cudaPeekAtLastError())
    print("primary ctx state", drv.cuDevicePrimaryCtxGetState(0))
    for m, r in rts.items():
        ws = r.workspace
        h, d = ws.host_address, ws.device_address
        print(m, "host attrs", rt.cudaPointerGetAttributes(h)[0], "dev attrs", rt.cudaPointerGetAttributes(d)[0])
        err = rt.cudaMemcpyAsync(d, h, 64, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, r.stream.cuda_stream)
        print(m, "retry own stream", err, "default stream",
              rt.cudaMemcpyAsync(d, h, 64, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, 0))
    fresh = PinnedBuffer(4096)
    d = rts["eager"].workspace.device_address
    print("fresh pinned", rt.cudaMemcpyAsync(d, fresh.ptr, 64, rt.cudaMemcpyKind.cudaMemcpyHostToDevice, 0))
    print("sync", rt.cudaDeviceSynchronize(), "torch copy", torch.ones(4, device="cuda").sum().item())


ck = load_checkpoint(sys.argv[1])
batches = frozen_batches(sys.argv[1])
rts = {}
for m in ("eager", "graph-fixed", "graph-cached"):
    rts[m] = Runtime(ck, device="cuda", config=RuntimeConfig(mode=m, dtype="bf16", capacity=CAP))
    print(m, "warmup", rts[m].warmup(), rts[m].forward_name, flush=True)
    torch.cuda.synchronize()
for i, b in enumerate(batches):
    try:
        outs = {m: rts[m].run(b) for m in rts}
    except Exception as e:
        print("FAILED", type(e).__name__, e, flush=True)
        diagnose(rts)
        raise SystemExit(1) from None
    same = all(np.array_equal(o.logits, outs["eager"].logits) and np.array_equal(o.act, outs["eager"].act)
               for o in outs.values())
    print(i, "modes byte-identical", same, flush=True)
