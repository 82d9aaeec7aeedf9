#!/usr/bin/env python3
"""Runs `laya-pool bench` from a checkout (thin wrapper: the code is laya_pool.tools.bench)."""
import sys
from pathlib import Path

# The checkout root, for laya_pool where it is not installed.
sys.path.append(str(Path(__file__).resolve().parents[1]))

# make_request too: ../shared/device/peer_vs_project.py imports it from here (`from bench import make_request`).
from laya_pool.tools.bench import main, make_request  # noqa: E402, F401

if __name__ == "__main__":
    sys.exit(main())
