#!/usr/bin/env python3
"""Runs `laya-pool topology` from a checkout (thin wrapper: the code is laya_pool.tools.topology)."""
import sys
from pathlib import Path

# Last: the top-level rooms (kernels/, ...) must not shadow installed packages of the same name.
sys.path.append(str(Path(__file__).resolve().parents[1]))

from laya_pool.tools.topology import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
