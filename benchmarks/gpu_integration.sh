#!/usr/bin/env bash
# The lead's integration call after a round of kernel work (device tool, carry .e2e_bundle): the
# end-to-end GPU tests (V4.1 with and without the private decode graphs, V4, V3.2 and GLM-5) on the
# current auto dispatch, in parallel; the no-compile-after-warmup sweeps (V4.1, V4, V3.2); the host
# cost of the eager decode step; the decode GPU tests no earlier call ran.
# Each stage has its own time cap, so a slow one still leaves the others' results in $OUT.
#   usage: bash benchmarks/gpu_integration.sh
#   env: E2E_K, E2E_TIMEOUT (200), T_WARM (120), T_HOST (70), T_DECODE (60), HOST_ARGS
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
S="$OUT/summary.txt"
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))s"; }
E2E_K="${E2E_K:-}" E2E_ARGS="-n 5" E2E_TIMEOUT="${E2E_TIMEOUT:-200}" bash tests/e2e/gpu_run.sh > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? $(tail -1 "$OUT/e2e.log") $(el)" >> "$S"
export DSV4_AMPERE_IMPL=portable PYTHONUNBUFFERED=1
timeout "${T_WARM:-120}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_warm_set.py -k "no_compile" -n 3 \
  > "$OUT/warm.log" 2>&1
echo "no-compile sweep rc=$? $(tail -1 "$OUT/warm.log") $(el)" >> "$S"
if [ -n "${HOST_ARGS:-}" ]; then
  timeout "${T_HOST:-70}" python3 benchmarks/bench_host_cost.py $HOST_ARGS > "$OUT/host.log" 2>&1
  echo "host cost rc=$? $(el)" >> "$S"
fi
timeout "${T_DECODE:-60}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_heads.py tests/test_decode_v2.py \
  -n 4 > "$OUT/decode_tests.log" 2>&1
echo "decode heads/v2 GPU tests rc=$? $(tail -1 "$OUT/decode_tests.log") $(el)" >> "$S"
cat "$S"
