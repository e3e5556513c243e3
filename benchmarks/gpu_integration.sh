#!/usr/bin/env bash
# The lead's integration call after a round of kernel work (device tool, carry .e2e_bundle): the
# end-to-end GPU test of V4.1 (with and without the private decode graphs) on the current auto
# dispatch, the decode composite under torch.compile, and the no-compile-after-warmup sweep.
# Each stage has its own time cap, so a slow one still leaves the others' results in $OUT.
#   usage: bash benchmarks/gpu_integration.sh     env: E2E_K (v41), E2E_TIMEOUT (120), T_COMPILE (45), T_WARM (70)
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
S="$OUT/summary.txt"
t0=$(date +%s)
el() { echo "$(( $(date +%s) - t0 ))s"; }
E2E_K="${E2E_K:-v41}" E2E_TIMEOUT="${E2E_TIMEOUT:-120}" bash tests/e2e/gpu_run.sh > "$OUT/e2e.log" 2>&1
echo "e2e rc=$? $(tail -1 "$OUT/e2e.log") $(el)" >> "$S"
export DSV4_AMPERE_IMPL=portable PYTHONUNBUFFERED=1
timeout "${T_COMPILE:-45}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_dsv4_decode.py -k "compile or graph" \
  > "$OUT/decode_compile.log" 2>&1
echo "decode compile/graph rc=$? $(tail -1 "$OUT/decode_compile.log") $(el)" >> "$S"
timeout "${T_WARM:-70}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_warm_set.py -k "no_compile" \
  > "$OUT/warm.log" 2>&1
echo "no-compile sweep rc=$? $(tail -1 "$OUT/warm.log") $(el)" >> "$S"
cat "$S"
