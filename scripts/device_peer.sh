#!/usr/bin/env bash
# Same-run comparison on the device (called by device_fast.sh peer): a live pool with one graph-cached worker,
# then ../shared/device's peer_vs_project.py and pool_overhead.py (copied into devtools/, carried).
FE=tcp://127.0.0.1:5599
python3 -m laya_pool up --model /tmp/large --devices cuda:0 --frontend $FE > "$OUT/pool.log" 2>&1 &
POOL=$!
t0=$(date +%s)
bash scripts/wait_ready.sh $FE 150 && echo "pool ready after $(( $(date +%s) - t0 ))s" || echo "pool NOT ready after 150s"
timeout 300 python3 devtools/peer_vs_project.py /tmp/large $FE 2>&1 | grep -vE "Warning|warn" | tail -14
timeout 60 python3 devtools/pool_overhead.py /tmp/large $FE 2>&1 | tail -3
kill -TERM $POOL; wait $POOL; echo "pool exit code $?"
tail -3 "$OUT/pool.log"
