#!/usr/bin/env bash
# The indexer's decode logits at an A100's SM counts in one device call (issue 28 item 6):
# benchmarks/bench_indexer_sms.py on 132, 112 and 104 SMs of the H200 through driver green contexts,
# portable, every tl.dot as mma.sync.
# usage: bash benchmarks/device/indexer_sms.sh   env: SMS (132,112,104), SHAPES (B:H,...), NAME (indexer_sms),
#        SWEEP (programs an SM forced, N,...), BENCH_TIMEOUT (150).  Results: $OUT/results.tgz (the table, the bench log), logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
timeout "${BENCH_TIMEOUT:-150}" python3 benchmarks/bench_indexer_sms.py --out "$OUT/results" --name "${NAME:-indexer_sms}" \
  --sms "${SMS:-132,112,104}" ${SHAPES:+--shapes "$SHAPES"} ${SWEEP:+--sweep "$SWEEP"} > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'B'" "$OUT/logs/bench.log") rows; $(grep 'copy GB' "$OUT/logs/bench.log")"
cp "$OUT/summary.txt" "$OUT/logs/bench.log" "$OUT/results/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
