#!/usr/bin/env bash
# Issue 20 (V3.2 / GLM-5 kernels): all GPU work for the v32_* ops in one device call (<= 270 s).
#   stage 1, in parallel (GPU correctness work and compiles; nothing timed):
#     - every test of tests/test_v32_ops.py that the GPU runs (the gpu-marked ones and the
#       interpreter tests, which run on CUDA when there is one), portable variant, no AOT (the
#       CPU suite compiles that), pytest-xdist -n $WORKERS, pytest-timeout per test;
#     - tests/memcheck_v32.py under compute-sanitizer memcheck (adversarial slots; every
#       decode form; it exits non-zero on a result that differs from the reference too);
#     - bench_v32.py --compile-only in two processes (one call per timed case: the timed run
#       then loads every kernel from the cache);
#   stage 2, alone on the GPU: bench_v32.py (the decode table T in {1,16,64,128} x H in {16,128},
#     K = 2048, every form; the prefill table), into $OUT/results, tarred.
# At most 8 files come back: summary.txt, pytest.log, memcheck.log, warm.log, bench.log, results.tgz.
#   usage: bash benchmarks/device/v32.sh   env: WORKERS (8), TEST_TIMEOUT (110), MC_TIMEOUT (110),
#          WARM_TIMEOUT (100), BENCH_TIMEOUT (125), SKIP_INSTALL (0)
set -u -o pipefail
OUT="${OUT:-/tmp/v32_out}"
mkdir -p "$OUT/results"
# DISABLE_MMA_V3=1: every tl.dot as mma.sync, as on sm_80 (no wgmma on the H200 either)
export PYTHONUNBUFFERED=1 DSV4_AMPERE_IMPL=portable DISABLE_MMA_V3=1
S="$OUT/summary.txt"
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))s"; }

if [ "${SKIP_INSTALL:-0}" != 1 ]; then
  python3 -m pip install --no-deps --no-build-isolation -e . -q > /tmp/v32_install.log 2>&1 || { tail -20 /tmp/v32_install.log | tee -a "$S"; exit 1; }
fi
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())' >> "$S" 2>&1
echo "start $(el) commit ${DSV4_BENCH_COMMIT:-?}" >> "$S"

( timeout "${TEST_TIMEOUT:-110}" python3 -m pytest tests/test_v32_ops.py -v --tb=short -p no:cacheprovider \
    -n "${WORKERS:-8}" --timeout=100 -k "not native and not aot" > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? $(tail -1 "$OUT/pytest.log") $(el)" >> "$S" ) &
( timeout "${MC_TIMEOUT:-110}" compute-sanitizer --tool memcheck --error-exitcode 3 python3 tests/memcheck_v32.py \
    > "$OUT/memcheck.log" 2>&1
  echo "memcheck rc=$? $(grep -E 'ERROR SUMMARY|memcheck_v32' "$OUT/memcheck.log" | tr '\n' ' ') $(el)" >> "$S" ) &
( timeout "${WARM_TIMEOUT:-100}" python3 benchmarks/bench_v32.py --compile-only --shapes 1x16,16x16,64x16,128x16 \
    > "$OUT/warm.log" 2>&1; echo "warm(1) rc=$? $(el)" >> "$S" ) &
( timeout "${WARM_TIMEOUT:-100}" python3 benchmarks/bench_v32.py --compile-only --no-prefill \
    --shapes 1x128,16x128,64x128,128x128 > /tmp/v32_warm2.log 2>&1; echo "warm(2) rc=$? $(el)" >> "$S" ) &
wait
cat /tmp/v32_warm2.log >> "$OUT/warm.log"

timeout "${BENCH_TIMEOUT:-125}" python3 benchmarks/bench_v32.py --out "$OUT/results" > "$OUT/bench.log" 2>&1
echo "bench rc=$? $(tail -1 "$OUT/bench.log") $(el)" >> "$S"
tar -czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
grep -E "^(FAILED|ERROR) " "$OUT/pytest.log" | head -40 >> "$S"
cat "$S"
