"""A decision loop embeds the client: importing it must not drag in torch or transformers."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_PROBE = """
import json, sys
import laya_pool.client
from laya_pool.client import ModelCard, decode_answers, encode_request
import laya_pool.client.card, laya_pool.client.decode, laya_pool.client.semantics
import laya_pool.client.abstain, laya_pool.client.batching, laya_pool.client.calibration, laya_pool.client.scan
import laya_pool.client.structured
card = ModelCard.from_dir(sys.argv[1], fingerprint="probe")
enc = encode_request(card, "a state", {"u": {"type": "noul", "instructions": "ok?"}})
import numpy as np
decode_answers(card, enc, np.zeros(2, np.float32), np.full((1, card.n_act), 0.5, np.float32))
heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "laya")
               or m.split(".")[1:2] in (["kernels"], ["worker"]))
print(json.dumps(heavy))
"""


def test_client_imports_no_torch_or_transformers(tiny_ckpt):
    out = subprocess.run([sys.executable, "-c", _PROBE, str(tiny_ckpt)], cwd=ROOT, check=True,
                         capture_output=True, text=True, timeout=120)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_client_modules_name_no_heavy_imports():
    # a lazy `import torch` inside a function would pass the probe above and still cost a user later
    for name in ("card.py", "semantics.py", "decode.py", "errors.py", "retry.py", "__init__.py", "abstain.py",
                 "batching.py", "calibration.py", "scan.py", "structured.py", "pool.py"):
        text = (ROOT / "laya_pool" / "client" / name).read_text(encoding="utf-8")
        for heavy in ("import torch", "from torch", "import transformers", "from transformers",
                      "laya_pool.kernels", "laya_pool.worker", "from ..", "import laya_pool"):
            assert heavy not in text, (name, heavy)
