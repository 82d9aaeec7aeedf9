#!/usr/bin/env bash
# On the device: generate the large checkpoint (timed) and load it with the official SDK.
set -uo pipefail
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
CK=${1:-/tmp/large}
/usr/bin/time -f "large checkpoint generated in %e s (max RSS %M KB)" python3 scripts/make_checkpoint.py --out "$CK" --preset large --seed 0
python3 - "$CK" <<'PY'
import sys, time, warnings
warnings.simplefilter("ignore")
import laya
t = time.perf_counter()
a = laya.load(sys.argv[1], device="cuda")
n = sum(p.numel() for p in a.model.parameters())
r = a.predict("The server crashes after the last deploy, rollback please",
              {"team": {"type": "choice", "instructions": "Which team?", "criteria": ["billing", "tech", "sales"]},
               "urgent": {"type": "noul", "instructions": "Is this urgent?"}})
print(f"SDK loaded the large checkpoint on cuda in {time.perf_counter() - t:.1f} s: {n / 1e6:.1f} M parameters;",
      {k: v.get("probabilities", v.get("noul")) for k, v in r["answers"].items()})
PY
