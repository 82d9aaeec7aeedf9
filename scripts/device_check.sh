#!/usr/bin/env bash
# One device call: install the carried wheels, run the gpu-marked tests, then the benchmark.
# Usage (device tool): bash scripts/device_check.sh [pytest args...]   results land in $OUT
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)'
python3 -m pytest -q -p no:cacheprovider -m gpu -s "$@" 2>&1 | tee "$OUT/gpu_tests.log"
