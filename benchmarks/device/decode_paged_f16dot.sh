#!/usr/bin/env bash
# The fp16-dot decode (decode mode v3, configs kh/gh: the kernels of csrc_triton/decode/paged_f16dot.py) in one device call:
#   A (in parallel): the GPU tests of tests/test_decode_paged.py picked by PYTEST_K, and a warm-up
#     bench at 2 shapes (fills the Triton cache with every specialization the sweep launches);
#   B: the sweep (benchmarks/bench_decode_paged.py --name decode_paged_f16dot) alone on the GPU;
#   C: ncu (--clock-control none; stall reasons, issue, smem / L2) of NCU_CASES, when set;
#   D: compute-sanitizer memcheck of MEMCHECK_FORMS, when set.
# usage: bash benchmarks/device/decode_paged_f16dot.sh   env: CONFIGS, SHAPES, PYTEST_K, NCU_CASES, MEMCHECK_FORMS,
#        BENCH_BUDGET_S (80), DSV4_BENCH_COMMIT. Results: $OUT/results.tgz, logs: $OUT/logs.tgz.
source "$(dirname "$0")/preamble.sh"
CONFIGS="${CONFIGS:-h16n32w4,kh16n32w4,gh16n32w4,kh32n32w8,kh16n32w8}"
( timeout "${TEST_TIMEOUT:-55}" python3 -m pytest tests/test_decode_paged.py -q -m gpu -p no:cacheprovider -k "${PYTEST_K:-v4}" \
    > "$OUT/logs/pytest_gpu.log" 2>&1; echo "pytest rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log")" > "$OUT/logs/pytest.rc" ) &
timeout 55 python3 benchmarks/bench_decode_paged.py --out "$OUT/logs" --name warmup --no-pipe --quick --configs "$CONFIGS" \
  --shapes 1:64:512,256:128:512,64:8:512 > "$OUT/logs/warmup.log" 2>&1
summary "warm-up rc=$? at $(( $(date +%s) - t0 )) s"
wait
summary "$(cat "$OUT/logs/pytest.rc") at $(( $(date +%s) - t0 )) s"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-80}" timeout $(( ${BENCH_BUDGET_S:-80} + 25 )) python3 benchmarks/bench_decode_paged.py \
  --out "$OUT/results" --name decode_paged_f16dot --no-pipe --configs "$CONFIGS" ${SHAPES:+--shapes "$SHAPES"} > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'T'" "$OUT/logs/bench.log") rows"
if [ -n "${NCU_CASES:-}" ]; then
  timeout "${NCU_TIMEOUT:-40}" ncu --clock-control none -k regex:_dsv4_decode_v --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis python3 benchmarks/ncu_decode_paged.py "$NCU_CASES" > "$OUT/results/ncu.txt" 2>&1
  summary "ncu rc=$? at $(( $(date +%s) - t0 )) s"
fi
if [ -n "${MEMCHECK_FORMS:-}" ]; then
  MEMCHECK_VARIANTS=portable timeout "${MEMCHECK_TIMEOUT:-45}" compute-sanitizer --tool memcheck --error-exitcode 3 \
    python3 tests/memcheck_decode_paged.py > "$OUT/logs/memcheck.log" 2>&1
  summary "memcheck rc=$? $(grep -E 'ERROR SUMMARY|memcheck_decode_paged' "$OUT/logs/memcheck.log" | tail -2 | tr '\n' ' ') at $(( $(date +%s) - t0 )) s"
fi
cp "$OUT/summary.txt" "$OUT/results/"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
