#!/usr/bin/env bash
# The decode on ragged batches (issue 28 item 1: what a balanced step plan could gain) in one device call:
# benchmarks/bench_decode_ragged.py on 132 and 104 SMs of the H200 through driver green contexts, portable, every
# tl.dot as mma.sync; P2 timed beside ours when DSV4_P2_DIR holds a local attention.py (never committed).
# usage: bash benchmarks/device/decode_ragged.sh   env: SMS (132,104), SHAPES (T:H,...), NAME (decode_ragged),
#        DSV4_P2_DIR, BENCH_TIMEOUT (200), STEP_PLANS (set: also ours with one balanced plan a step).  Results: $OUT/results.tgz (the table, the bench log), logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_decode_ragged.py --out "$OUT/results" --name "${NAME:-decode_ragged}" \
  --sms "${SMS:-132,104}" ${SHAPES:+--shapes "$SHAPES"} ${STEP_PLANS:+--step-plans} > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'mix'" "$OUT/logs/bench.log") rows, $(grep -c FAIL "$OUT/logs/bench.log") FAIL; $(grep '^P2' "$OUT/logs/bench.log")"
cp "$OUT/summary.txt" "$OUT/logs/bench.log" "$OUT/results/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
