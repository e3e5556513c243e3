#!/usr/bin/env bash
# The lead's integration call after a round of kernel work (device tool, carry .e2e_bundle): the
# end-to-end GPU tests (V4.1 with and without the private decode graphs, V4, V3.2 and GLM-5) on the
# current auto dispatch, in parallel; the host-cost GPU tests and benchmark of the eager decode step;
# the no-compile-after-warmup sweeps (V4.1, V4, V3.2); the V3.2 comparison with vLLM's ROCm Triton
# kernels; the decode GPU tests no earlier call ran. Each stage has its own time cap, so a slow one
# still leaves the others' results in $OUT.
#   usage: bash benchmarks/device/integration.sh
#   env: E2E_K, E2E_TIMEOUT (200), T_HOST (90), T_WARM (100), T_ROCM (60, 0 = skip), T_DECODE (50, 0 = skip)
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
S="$OUT/summary.txt"
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))s"; }
E2E_K="${E2E_K:-}" E2E_ARGS="-n 5" E2E_TIMEOUT="${E2E_TIMEOUT:-200}" bash tests/e2e/gpu_run.sh > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? $(tail -1 "$OUT/e2e.log") $(el)" >> "$S"
export DSV4_AMPERE_IMPL=portable PYTHONUNBUFFERED=1 DSV4_BENCH_COMMIT="${DSV4_BENCH_COMMIT:-unknown}"
timeout "${T_HOST:-90}" bash -c "python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_host_cost.py > '$OUT/host_tests.log' 2>&1; \
  echo \"host tests rc=\$? \$(tail -1 '$OUT/host_tests.log')\" >> '$S'; python3 benchmarks/bench_host_cost.py --out '$OUT/host' > '$OUT/host.log' 2>&1"
echo "host cost bench rc=$? $(el)" >> "$S"
timeout "${T_WARM:-100}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_warm_set.py -k "no_compile" -n 3 \
  > "$OUT/warm.log" 2>&1
echo "no-compile sweep rc=$? $(tail -1 "$OUT/warm.log") $(el)" >> "$S"
if [ "${T_ROCM:-60}" != 0 ]; then
  DISABLE_MMA_V3=1 PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm timeout "${T_ROCM:-60}" python3 benchmarks/bench_v32_rocm.py \
    --out "$OUT/v32rocm" --budget-s $(( ${T_ROCM:-60} - 15 )) > "$OUT/v32rocm.log" 2>&1
  echo "v32 vs ROCm bench rc=$? $(el)" >> "$S"
fi
if [ "${T_DECODE:-50}" != 0 ]; then
  timeout "${T_DECODE:-50}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_heads.py tests/test_decode_gather.py \
    -n 4 > "$OUT/decode_tests.log" 2>&1
  echo "decode heads/v2 GPU tests rc=$? $(tail -1 "$OUT/decode_tests.log") $(el)" >> "$S"
fi
cat "$S"
