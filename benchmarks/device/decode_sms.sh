#!/usr/bin/env bash
# The decode at an A100's SM counts in one device call (benchmarks/bench_decode_sms.py on 132, 112 and 104 SMs of the
# H200 through driver green contexts, portable, every tl.dot as mma.sync):
#   A: benchmarks/green_ctx.py's self-check (the SMs each count's stream reaches, a matmul's time on it);
#   B: the sweep; P2 timed beside ours when DSV4_P2_DIR holds a local attention.py (never committed);
#   C: PYTEST_FILES (pytest -m gpu, -n 16 workers, -k PYTEST_K) when set, after the bench.
# usage: bash benchmarks/device/decode_sms.sh   env: SMS (132,112,104), SHAPES, SWEEP (1: --sweep), NAME (decode_sms),
#        SKIP_SELFCHECK (1: no step A; the bench's GreenStream still probes each count), REPLAYS (20), BENCH_BUDGET_S (200), DSV4_P2_DIR, PYTEST_FILES, PYTEST_K, PYTEST_SMS (DSV4_AMPERE_SMS for the tests), TEST_TIMEOUT (120), DSV4_BENCH_COMMIT.
# Results: $OUT/results.tgz (the tables), logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
[ "${SKIP_SELFCHECK:-0}" = 1 ] || timeout 60 python3 benchmarks/green_ctx.py ${SMS:+$(echo "$SMS" | tr ',' ' ')} > "$OUT/logs/green_ctx.log" 2>&1
summary "green_ctx rc=$?: $(tr '\n' ';' < "$OUT/logs/green_ctx.log" | tail -c 400)"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-200}" timeout $(( ${BENCH_BUDGET_S:-200} + 60 )) python3 benchmarks/bench_decode_sms.py \
  --out "$OUT/results" --name "${NAME:-decode_sms}" --sms "${SMS:-132,112,104}" ${SHAPES:+--shapes "$SHAPES"} \
  --replays "${REPLAYS:-20}" $( [ "${SWEEP:-0}" = 1 ] && echo --sweep ) \
  > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'T'" "$OUT/logs/bench.log") rows; $(grep -E '^P2|copy GB' "$OUT/logs/bench.log" | tr '\n' ' ')"
if [ -n "${PYTEST_FILES:-}" ]; then
  DSV4_AMPERE_SMS="${PYTEST_SMS:-}" timeout "${TEST_TIMEOUT:-120}" python3 -m pytest $PYTEST_FILES -q -m gpu -p no:cacheprovider -n 16 ${PYTEST_K:+-k "$PYTEST_K"} \
    > "$OUT/logs/pytest_gpu.log" 2>&1
  summary "pytest rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log") at $(( $(date +%s) - t0 )) s"
fi
cp "$OUT/summary.txt" "$OUT/results/"
cp "$OUT/logs/bench.log" "$OUT/results/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
