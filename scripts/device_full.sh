#!/usr/bin/env bash
# One device call for the whole GPU story; everything it prints also lands in $OUT.
#   bash scripts/device_full.sh [tests|cache|bench|demo|load]...   (default: tests cache bench demo)
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
steps=${*:-tests cache bench demo}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
for step in $steps; do
  case $step in
    tests) python3 -m pytest -q -p no:cacheprovider -m gpu -s tests/ 2>&1 | tee "$OUT/gpu_tests.log" | grep -vE "^\s*$" | tail -25 ;;
    cache) python3 scripts/check_cache_gpu.py --report "$OUT/check_cache_gpu.json" 2>&1 | tail -14 ;;
    bench)
      [ -d /tmp/large ] || python3 scripts/make_checkpoint.py --out /tmp/large --preset large --seed 0
      FE=tcp://127.0.0.1:5599
      python3 -m laya_pool up --model /tmp/large --devices cuda:0 --frontend $FE > "$OUT/pool.log" 2>&1 &
      POOL=$!
      for i in $(seq 120); do
        python3 -m laya_pool status --frontend $FE --json 2>/dev/null | grep -q '"state": "ready"' && break; sleep 1
      done
      python3 scripts/bench.py --model /tmp/large --device cuda --frontend $FE --out "$OUT" ${BENCH_ARGS:-} 2>&1 | tail -32
      kill -TERM $POOL; wait $POOL; echo "pool exit code $?" ;;
    demo) timeout 300 python3 scripts/demo.py 2>&1 | tail -25; echo "demo exit code $?" ;;
    load)
      # One GPU, large preset, 64 requests of 1x48 in flight. 1: a worker that runs one request at a time
      # (--max-batch 1) against the default that merges what is queued. 2: two workers on the GPU, one
      # SIGKILLed mid-run (issue 7's protocol; on nvidia-h200-x2: --baseline-devices cuda:0 --devices cuda:0,cuda:1).
      [ -d /tmp/large ] || python3 scripts/make_checkpoint.py --out /tmp/large --preset large --seed 0
      python3 scripts/load.py --model /tmp/large --baseline-devices cuda:0 --baseline-args "--max-batch 1" \
        --devices cuda:0 --concurrency 64 --procs 8 --seconds 10 --out "$OUT/load_batching.json" 2>&1 | tail -4
      python3 scripts/load.py --model /tmp/large --devices cuda:0 --workers-per-device 2 --concurrency 64 \
        --procs 8 --seconds 10 --kill-after 4 --out "$OUT/load_kill.json" 2>&1 | tail -4; echo "load exit code $?" ;;
  esac
done
