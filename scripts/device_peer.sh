#!/usr/bin/env bash
# Same-run comparison on the device (called by device_fast.sh peer): a live pool with one graph-cached worker,
# then ../shared/device's peer_vs_project.py and pool_overhead.py (copied into devtools/, carried).
FE=tcp://127.0.0.1:5599
python3 -m laya_pool up --model /tmp/large --devices cuda:0 --frontend $FE > "$OUT/pool.log" 2>&1 &
POOL=$!
for i in $(seq 150); do
  python3 -m laya_pool status --frontend $FE --json 2>/dev/null | grep -q '"state": "ready"' && break; sleep 1
done
echo "pool ready after ${i}s"
timeout 300 python3 devtools/peer_vs_project.py /tmp/large $FE 2>&1 | grep -vE "Warning|warn" | tail -14
timeout 60 python3 devtools/pool_overhead.py /tmp/large $FE 2>&1 | tail -3
kill -TERM $POOL; wait $POOL; echo "pool exit code $?"
tail -3 "$OUT/pool.log"
