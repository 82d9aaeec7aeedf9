#!/usr/bin/env bash
# A/B of two trees on one machine, same run: both trees' pools up at once, each tree's own client timing back-to-back
# 1x48 lane calls against its own pool, in alternation (a fresh client process a block), then the judge's
# pool_overhead.py once per tree. What the thirty-first session's A/B did by hand (docs/PERF.md).
#
#   here:   git archive --prefix=base/ COMMIT | tar -x -C devtools/      (devtools/ git-excluded; carry it)
#   device: bash scripts/device_fast.sh ab     (its install first; AB_BASE, AB_ROUNDS: ab_pools.sh's arguments)
#
# The base tree needs scripts/round_trip.py (e8848f5 on). AB_MODEL (default /tmp/large) and AB_DEVICES (default
# cuda:0) let it run on a CPU pool too, to check the script. Prints one line per block and the judge's lines.
set -uo pipefail
BASE=$(cd "$1" && pwd); ROUNDS=${2:-3}; NEW=$PWD
MODEL=${AB_MODEL:-/tmp/large}; DEVICES=${AB_DEVICES:-cuda:0}; SITE=${AB_SITE:-/tmp/site}
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
declare -A FE=([base]=tcp://127.0.0.1:5591 [new]=tcp://127.0.0.1:5592) TREE=([base]=$BASE [new]=$NEW)
PIDS=()
for t in base new; do
  (cd "${TREE[$t]}" && PYTHONPATH=$SITE:${TREE[$t]} exec python3 -m laya_pool up --model "$MODEL" --devices "$DEVICES" \
    --frontend "${FE[$t]}" > "$OUT/ab-$t-pool.log" 2>&1) & PIDS+=($!)
done
for t in base new; do
  PYTHONPATH=$SITE:$NEW bash "$NEW/scripts/wait_ready.sh" "${FE[$t]}" 240 \
    || { echo "the $t pool is NOT ready (see $OUT/ab-$t-pool.log)"; kill -TERM "${PIDS[@]}"; wait; exit 1; }
done
for r in $(seq "$ROUNDS"); do
  for t in base new; do
    line=$(cd "${TREE[$t]}" && PYTHONPATH=$SITE:${TREE[$t]} timeout 60 python3 scripts/round_trip.py \
      --frontend "${FE[$t]}" --seconds 3 --json "$OUT/ab-$t-$r.json" 2>&1 | grep -E "^total|calls")
    echo "round $r $t: $(echo "$line" | tr '\n' ' ')"
  done
done
if [ -f "$NEW/devtools/pool_overhead.py" ]; then
  for t in base new; do
    echo "== judge, $t"
    (cd "${TREE[$t]}" && PYTHONPATH=$SITE:${TREE[$t]} timeout 200 python3 "$NEW/devtools/pool_overhead.py" "$MODEL" \
      "${FE[$t]}" 2>&1 | grep -vE "Warning|warn" | tail -4)
  done
fi
kill -TERM "${PIDS[@]}"; wait
