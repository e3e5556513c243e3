#!/usr/bin/env bash
# Sparse MLA prefill at an A100's SM counts in one device call (issue 28's prefill goal):
# benchmarks/bench_prefill_sms.py on 132 and 104 SMs of the H200 through driver green contexts, portable, every
# tl.dot as mma.sync; P2 timed beside ours when DSV4_P2_DIR holds a local attention.py (never committed).
# usage: bash benchmarks/device/prefill_sms.sh   env: SMS (132,104), HEADS (8,16,64,128), NAME (prefill_sms), CONFIGS (bh:i,...),
#        DSV4_P2_DIR, BENCH_TIMEOUT (200).  Results: $OUT/results.tgz (the table, the bench log), logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
timeout "${BENCH_TIMEOUT:-200}" python3 benchmarks/bench_prefill_sms.py --out "$OUT/results" --name "${NAME:-prefill_sms}" \
  --sms "${SMS:-132,104}" --heads "${HEADS:-8,16,64,128}" ${CONFIGS:+--configs "$CONFIGS"} > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'s_q'" "$OUT/logs/bench.log") rows; $(grep '^P2' "$OUT/logs/bench.log")"
cp "$OUT/summary.txt" "$OUT/logs/bench.log" "$OUT/results/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
