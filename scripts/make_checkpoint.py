#!/usr/bin/env python3
"""Runs `laya-pool make-checkpoint` from a checkout (thin wrapper: the code is laya_pool.tools.make_checkpoint)."""
import sys
from pathlib import Path

# The checkout root, for laya_pool where it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from laya_pool.tools.make_checkpoint import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
