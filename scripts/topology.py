#!/usr/bin/env python3
"""Runs `laya-pool topology` from a checkout (thin wrapper: the code is laya_pool.tools.topology)."""
import sys
from pathlib import Path

# The checkout root, for laya_pool where it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from laya_pool.tools.topology import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
