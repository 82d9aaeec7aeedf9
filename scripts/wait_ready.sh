#!/usr/bin/env bash
# Wait until the pool at FE lists a ready worker: exit 0, or 1 after SECONDS (default 120).
#   bash scripts/wait_ready.sh FE [SECONDS]
FE=$1; end=$(( $(date +%s) + ${2:-120} ))
while [ "$(date +%s)" -lt $end ]; do
  python3 -m laya_pool status --frontend "$FE" --json 2>/dev/null | grep -q '"state": "ready"' && exit 0
  sleep 0.5
done
exit 1
