#!/usr/bin/env python3
"""Device debug: tests/test_runtime_gpu.py's first test as a plain script (same order, nothing before it)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from test_runtime_gpu import CAP, frozen_batches  # noqa: E402

from worker.checkpoint import load_checkpoint  # noqa: E402
from worker.runtime import Runtime, RuntimeConfig  # noqa: E402

ck = load_checkpoint(sys.argv[1])
batches = frozen_batches(sys.argv[1])
rts = {}
for m in ("eager", "graph-fixed", "graph-cached"):
    rts[m] = Runtime(ck, device="cuda", config=RuntimeConfig(mode=m, dtype="bf16", capacity=CAP))
    print(m, "warmup", rts[m].warmup(), flush=True)
    torch.cuda.synchronize()
for i, b in enumerate(batches):
    outs = {m: rts[m].run(b) for m in rts}
    same = all(np.array_equal(o.logits, outs["eager"].logits) and np.array_equal(o.act, outs["eager"].act)
               for o in outs.values())
    print(i, "modes byte-identical", same, flush=True)
