#!/usr/bin/env python3
"""`make demo`: generate the tiny checkpoint if missing and show what the project can do so far."""
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from scripts.make_checkpoint import make_checkpoint  # noqa: E402
from worker.checkpoint import load_checkpoint  # noqa: E402


def main() -> int:
    ckpt = ROOT / "checkpoints" / "tiny"
    if not (ckpt / "model.safetensors").exists():
        make_checkpoint(ckpt, "tiny", 0)
    t0 = time.perf_counter()
    ck = load_checkpoint(ckpt)
    print(f"loaded {ckpt}: {ck.arch.parameter_count() / 1e6:.2f} M parameters, fingerprint {ck.fingerprint[:16]}, "
          f"{(time.perf_counter() - t0) * 1e3:.0f} ms")
    print("the pool is not built yet; nothing is served")
    return 0


if __name__ == "__main__":
    sys.exit(main())
