#!/usr/bin/env bash
# Issue 17's legs no earlier device call reached, in one call (~3.5 min on a warm H200):
#   A (in parallel with B): the GPU tests of tests/test_decode_paged.py never run on a GPU: every v4
#     config (kh32n64w8, the shared-memory-gated one, included) against float64, CUDA-graph replay
#     == eager through v4 configs, torch.compile(fullgraph=True), int64 adversarial slots;
#   B: compute-sanitizer memcheck of the fused path on adversarial slots (MEMCHECK_FORMS);
#   C (alone on the GPU): the decode sweep in a green context of 108 SMs (an A100's count), plans
#     made for 108 (bench_decode_paged.py --sms 108 --name decode_v4_108sm), shapes in priority order.
#     Ran once (2026-12-01, torch 2.11): the context did not confine the kernels (results renamed
#     decode_paged_f16dot_splits.md); bench_decode_paged --sms now refuses torch < 2.12.
# usage: bash benchmarks/device/decode_paged_verify.sh   env: T_TESTS (90), T_MEM (100), BENCH_BUDGET_S (60),
#        MEMCHECK_FORMS, SHAPES, CONFIGS, DSV4_BENCH_COMMIT. Results: $OUT/results.tgz, logs: $OUT/logs.tgz.
SUMMARY="${OUT:-/tmp/dsv4_out}/results/summary.txt"
source "$(dirname "$0")/preamble.sh"
( timeout "${T_TESTS:-90}" python3 -m pytest tests/test_decode_paged.py -q -m gpu -p no:cacheprovider -n 6 -rf \
    -k "(v4_matches_reference or graph_replay or torch_compile or int64 or every_dispatched) and portable" \
    > "$OUT/logs/pytest_gpu.log" 2>&1; echo "decode v3/v4 GPU tests rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log")" \
    > "$OUT/logs/pytest.rc" ) &
( export MEMCHECK_VARIANTS=portable MEMCHECK_FORMS="${MEMCHECK_FORMS:-kh16n32w4,kh32n64w8,v3}"
  # compile outside the sanitizer first (it printed nothing in 80 s with cold JIT, twice)
  timeout 40 python3 tests/memcheck_decode_paged.py > "$OUT/logs/memcheck_warm.log" 2>&1
  timeout "${T_MEM:-100}" compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/memcheck_decode_paged.py \
    > "$OUT/logs/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|memcheck_decode_paged|FAIL' "$OUT/logs/memcheck.log" | tail -3 | tr '\n' ' ')" \
    > "$OUT/logs/memcheck.rc" ) &
wait
summary "$(cat "$OUT/logs/pytest.rc") at $(( $(date +%s) - t0 )) s"
summary "$(cat "$OUT/logs/memcheck.rc") at $(( $(date +%s) - t0 )) s"
SHAPES="${SHAPES:-64:64:512,128:64:512,4:64:512,256:64:512,64:8:512,128:8:512,16:64:512,64:64:128,128:128:128,64:128:512,16:8:512,256:8:512}"
BENCH_BUDGET_S="${BENCH_BUDGET_S:-60}" timeout $(( ${BENCH_BUDGET_S:-60} + 25 )) python3 benchmarks/bench_decode_paged.py \
  --out "$OUT/results" --name decode_v4_108sm --no-pipe --sms 108 --configs "${CONFIGS:-kh16n32w4,kh16n64w8,kh32n64w8}" \
  --shapes "$SHAPES" > "$OUT/logs/bench.log" 2>&1
summary "108-SM bench rc=$? at $(( $(date +%s) - t0 )) s: $(grep -c "'T'" "$OUT/logs/bench.log") rows"
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
