#!/usr/bin/env bash
# Issue 19 on the GPU in one device call (portable kernels):
#  1. the no-compile-after-warmup GPU test for V4.1 and V4 at TP 8 (pytest, each with an empty
#     TRITON_CACHE_DIR: its warmup is one worker's cold startup compile), then the same sweep
#     again on the filled cache (a restart: the warm startup),
#  2. the cost of DSV4_AMPERE_BATCH_INVARIANT=1 on the decode step (bench_startup.py),
#  3. TP 1 cold (and warm) startups of both models, then the determinism GPU tests, while the
#     time budget lasts.
# Results: $OUT/startup.{json,md} (bench_startup.py --assemble of the sweep lines), logs in
# $OUT/logs.tgz, $OUT/summary.txt (4 files back).   usage: OUT=... BUDGET=190 bash benchmarks/device/warm_set_batch_invariance.sh
set -u -o pipefail
OUT="${OUT:-/tmp/i19_out}"
BUDGET="${BUDGET:-190}"
W="$(mktemp -d)"; L="$W/logs"  # logs outside $OUT: they come back as one tarball
mkdir -p "$L"
export PYTHONUNBUFFERED=1 DSV4_AMPERE_IMPL=portable DSV4_WARM_REPORT="$L/sweeps.jsonl"
T0=$(date +%s)
S="$OUT/summary.txt"
el() { echo $(( $(date +%s) - T0 )); }
left() { local r=$(( BUDGET - $(el) )); [ "$r" -lt 1 ] && r=1; [ "$r" -lt "$1" ] && echo "$r" || echo "$1"; }
say() { echo "[$(el)s] $*" | tee -a "$S"; tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null; }
pack() { tar -czf "$OUT/logs.tgz" -C "$L" . 2>/dev/null; }
trap pack EXIT

python3 -m pip install --no-deps --no-build-isolation -e . -q > "$L/install.log" 2>&1 || { say "install failed"; tail -5 "$L/install.log"; exit 1; }
say "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"

sweep_warm() {  # model tp: the sweep again on its filled cache
  TRITON_CACHE_DIR="$W/c_$1_$2" DSV4_WARM_TAG=warm timeout "$(left 60)" python3 tests/test_warm_set.py --sweep "$1" "$2" \
    > "$L/sweep_warm_$1_$2.out" 2> "$L/sweep_warm_$1_$2.err"
  local rc=$?; grep -E '^\{' "$L/sweep_warm_$1_$2.out" >> "$DSV4_WARM_REPORT"
  say "sweep warm $1 TP$2 rc=$rc $(tail -c 400 "$L/sweep_warm_$1_$2.out")"
}

for m in v41 v4; do
  TRITON_CACHE_DIR="$W/c_${m}_8" DSV4_WARM_TAG=cold timeout "$(left 80)" python3 -m pytest -q -s -p no:cacheprovider --runxfail \
    "tests/test_warm_set.py::test_no_compile_after_warmup_on_a_mixed_batch_sweep[$m]" > "$L/pytest_sweep_$m.log" 2>&1
  say "pytest no-compile $m TP8 (cold) rc=$? $(tail -1 "$L/pytest_sweep_$m.log")"
  sweep_warm "$m" 8
done

timeout "$(left 50)" python3 benchmarks/bench_startup.py --out "$OUT" --part invariant > "$L/bench_invariant.log" 2>&1
say "batch-invariant bench rc=$? $(grep -c "'ratio'" "$L/bench_invariant.log") rows"

for m in v41 v4; do
  [ "$(left 40)" -lt 30 ] && { say "skip TP1 $m: budget"; continue; }
  TRITON_CACHE_DIR="$W/c_${m}_1" DSV4_WARM_TAG=cold timeout "$(left 60)" python3 tests/test_warm_set.py --sweep "$m" 1 \
    > "$L/sweep_cold_${m}_1.out" 2> "$L/sweep_cold_${m}_1.err"
  rc=$?; grep -E '^\{' "$L/sweep_cold_${m}_1.out" >> "$DSV4_WARM_REPORT"
  say "sweep cold $m TP1 rc=$rc $(tail -c 400 "$L/sweep_cold_${m}_1.out")"
done
for m in v41 v4; do
  [ "$(left 30)" -lt 20 ] && { say "skip TP1 warm $m: budget"; continue; }
  sweep_warm "$m" 1
done

python3 benchmarks/bench_startup.py --out "$OUT" --assemble "$DSV4_WARM_REPORT" > "$L/assemble.log" 2>&1
say "assemble rc=$?"

if [ "$(left 60)" -ge 40 ]; then
  timeout "$(left 60)" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_determinism.py > "$L/pytest_determinism.log" 2>&1
  say "pytest determinism rc=$? $(tail -1 "$L/pytest_determinism.log")"
else
  say "skip determinism: budget"
fi
say "done"
