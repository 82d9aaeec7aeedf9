#!/usr/bin/env python3
"""Device debug: where does a tiny Runtime on CUDA first fail? Each step synchronises and says OK or the error."""
import os
import sys
import traceback

# The checkout root, for laya_pool where it is not installed.
sys.path.append(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import numpy as np  # noqa: E402
import torch  # noqa: E402

from laya_pool.worker.batch import Batch  # noqa: E402
from laya_pool.worker.checkpoint import load_checkpoint  # noqa: E402
from laya_pool.worker.runtime import Runtime, RuntimeConfig  # noqa: E402
from laya_pool.worker.workspace import Capacity  # noqa: E402

ck = load_checkpoint(sys.argv[1])
mode = sys.argv[2] if len(sys.argv) > 2 else "eager"
rng = np.random.default_rng(0)
b = Batch.from_rows([(rng.integers(5, 1000, 48).astype(np.int32), np.array([1, 5, 9], np.int32), 0)])


def step(name, fn):
    try:
        out = fn()
        torch.cuda.synchronize()
        print("OK  ", name, flush=True)
        return out
    except Exception as e:
        print("FAIL", name, repr(e)[:300], flush=True)
        traceback.print_exc(limit=4)
        sys.exit(1)


cap = Capacity(max_tokens=16 * 512, max_rows=16, max_markers=1024, row_markers=64)
rt = step("runtime init", lambda: Runtime(ck, device="cuda", config=RuntimeConfig(mode=mode, capacity=cap)))
print("forward:", rt.forward_name, type(rt.model).__name__)
step("upload first", lambda: rt.upload.submit(rt.workspace.pack(b, rt.exact(b))) or rt.stream.synchronize())
step("one eager forward on the stream", lambda: rt._forward(rt.exact(b)) and rt.stream.synchronize())
step("upload after a forward", lambda: rt.upload.submit(rt.workspace.pack(b, rt.exact(b))) or rt.stream.synchronize())
step("eager forward at the fixed shape", lambda: rt._forward(rt.fixed_shape) and rt.stream.synchronize())
step("warmup", rt.warmup)
step("upload after warmup", lambda: rt.upload.submit(rt.workspace.pack(b, rt.exact(b))) or rt.stream.synchronize())
r = step("run", lambda: rt.run(b))
print("logits", r.logits, "act", r.act)
# As tests/test_runtime_gpu.py does: three runtimes in one process, each warmed, then each runs the batch.
rts = {m: step(f"init+warmup {m}", lambda m=m: (lambda r: (r.warmup(), r)[1])(
    Runtime(ck, device="cuda", config=RuntimeConfig(mode=m, dtype="bf16", capacity=cap))))
    for m in ("eager", "graph-fixed", "graph-cached")}
for m, r in rts.items():
    step(f"run {m}", lambda r=r: r.run(b))
# The frozen request cases of the gpu tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from test_runtime_gpu import frozen_batches  # noqa: E402

for i, fb in enumerate(frozen_batches(sys.argv[1])):
    step(f"frozen batch {i} ({fb.rows} rows, {fb.tokens} tokens) eager", lambda fb=fb: rts["eager"].run(fb))
