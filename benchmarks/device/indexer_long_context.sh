#!/usr/bin/env bash
# Issue 18's one GPU call (< 240 s): install, the indexer GPU tests (portable and native),
# bench_long_context.py (portable; the must-have, so second), bench_indexer.py (shipped configs
# + the new candidates, same run; what time is left). One log and the result files straight under $OUT (at most 8 files come back;
# no tarball, so whatever a stage wrote before a kill still comes back).
#   usage: DSV4_BENCH_COMMIT=<sha> bash benchmarks/device/indexer_long_context.sh
set -u -o pipefail
OUT="${OUT:-/tmp/out18}"
mkdir -p "$OUT"
LOG="$OUT/indexer_long_context.log"
export PYTHONUNBUFFERED=1
say() { echo "[$SECONDS s] $*" | tee -a "$LOG"; }
python3 -m pip install --no-deps --no-build-isolation -e . -q >> "$LOG" 2>&1 || { say "install failed"; tail -20 "$LOG"; exit 1; }
say "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"
timeout 55 python3 -m pytest tests -q -m gpu -k indexer -p no:cacheprovider >> "$LOG" 2>&1
say "pytest gpu -k indexer rc=$? $(grep -E '(passed|failed)' "$LOG" | tail -1)"
DSV4_AMPERE_IMPL=portable timeout 95 python3 benchmarks/bench_long_context.py --out "$OUT" --budget-s 80 >> "$LOG" 2>&1
say "bench_long_context rc=$?"
LEFT=$((228 - SECONDS))
timeout "$LEFT" python3 benchmarks/bench_indexer.py --out "$OUT" >> "$LOG" 2>&1
say "bench_indexer rc=$? (given $LEFT s)"
grep -E "FAILED|Error|error" "$LOG" | head -20
tail -5 "$LOG"
