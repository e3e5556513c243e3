#!/usr/bin/env bash
# Wide head groups at an A100's SM counts in one device call (issue 28 item 2), portable, every tl.dot as mma.sync:
#   A: the GPU tests of the paged decode (tests/test_decode_paged.py -m gpu, both variants; they also warm
#      Triton's cache for B), -n 16 workers, under TEST_TIMEOUT;
#   B: benchmarks/bench_decode_sms.py --sweep over CONFIGS (the dispatched kh32n64w8 beside the STREAM
#      configs sh..., the wide-P@V wh64n16w8) x splits <= MAX_SPLITS at the H >= 64 shapes, ours (auto) and P2 beside, on 132, 112, 104
#      SMs through driver green contexts, under BENCH_BUDGET_S.
# usage: bash benchmarks/device/decode_sms_heads.sh   env: SHAPES, CONFIGS, MAX_SPLITS (5), SMS (132,112,104),
#        BENCH_BUDGET_S (170), TEST_TIMEOUT (90), PYTEST_K, NAME (decode_sms_heads), DSV4_P2_DIR.
# Results: $OUT/results.tgz (tables, bench log, pytest tail), logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
DSV4_AMPERE_SMS= timeout "${TEST_TIMEOUT:-90}" python3 -m pytest tests/test_decode_paged.py -q -m gpu -p no:cacheprovider -n 16 \
  ${PYTEST_K:+-k "$PYTEST_K"} > "$OUT/logs/pytest_gpu.log" 2>&1
summary "pytest rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log") at $(( $(date +%s) - t0 )) s"
tail -40 "$OUT/logs/pytest_gpu.log" > "$OUT/results/pytest_gpu_tail.txt"
SHAPES="${SHAPES:-64:64:512,128:64:512,64:128:512,16:64:512,128:128:512,256:64:512,16:128:512,256:128:512,64:64:128,128:128:128}"
timeout $(( ${BENCH_BUDGET_S:-170} + 40 )) python3 benchmarks/bench_decode_sms.py --out "$OUT/results" \
  --name "${NAME:-decode_sms_heads}" --sms "${SMS:-132,112,104}" --shapes "$SHAPES" --sweep \
  --configs "${CONFIGS:-kh32n64w8,sh32n32w4,kh32n32w4,wh64n16w8,sh64n16w8}" --max-splits "${MAX_SPLITS:-5}" \
  --budget "${BENCH_BUDGET_S:-170}" --replays 10 > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'T'" "$OUT/logs/bench.log") rows; $(grep -E '^P2|copy GB' "$OUT/logs/bench.log" | tr '\n' ' ')"
cp "$OUT/summary.txt" "$OUT/logs/bench.log" "$OUT/results/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
