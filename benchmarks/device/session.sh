#!/usr/bin/env bash
# All GPU work of a session in one call (the device tool): install, `dsv4-ops check`, the GPU
# tests for both variants, compute-sanitizer memcheck, the exhaustive codec counts, then the
# benchmarks. Logs and results land in $OUT as two tarballs and a summary.
#   usage: bash benchmarks/device/session.sh [stages]   stages: any of check,tests,memcheck,exhaustive,bench
#   env: DSV4_BENCH_COMMIT (stamp; the device copy has stale git metadata), BENCHES (default benchmarks/bench_*.py), BENCH_TIMEOUT (150 s), TEST_TIMEOUT (420 s), PYTEST_ARGS
set -u -o pipefail
STAGES="${1:-check,tests,memcheck,exhaustive,bench}"
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT/logs" "$OUT/results"
export PYTHONUNBUFFERED=1
has() { [[ ",$STAGES," == *",$1,"* ]]; }
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }

python3 -m pip install --no-deps --no-build-isolation -e . -q > "$OUT/logs/install.log" 2>&1 || { cat "$OUT/logs/install.log"; exit 1; }
summary "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"

if has check; then
  python3 -m dsv4_ops check > "$OUT/logs/check.log" 2>&1; summary "check rc=$? $(tail -1 "$OUT/logs/check.log")"
  DSV4_AMPERE_IMPL=portable python3 -m dsv4_ops check --skip-aot > "$OUT/logs/check_portable.log" 2>&1
  summary "check (portable) rc=$? $(tail -1 "$OUT/logs/check_portable.log")"
fi
if has tests; then
  timeout "${TEST_TIMEOUT:-420}" python3 -m pytest tests -q -m "gpu and not slow" -p no:cacheprovider ${PYTEST_ARGS:-} > "$OUT/logs/pytest_gpu.log" 2>&1
  summary "pytest gpu rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log")"
fi
if has memcheck; then
  for script in tests/memcheck_*.py; do
    [ -f "$script" ] || continue
    for v in portable native; do
      DSV4_AMPERE_IMPL=$v timeout "${MEMCHECK_TIMEOUT:-150}" compute-sanitizer --tool memcheck --error-exitcode 3 python3 "$script" \
        > "$OUT/logs/memcheck_$(basename "$script" .py)_$v.log" 2>&1
      summary "memcheck $script $v rc=$? $(grep -E 'ERROR SUMMARY' "$OUT/logs/memcheck_$(basename "$script" .py)_$v.log" | tail -1)"
    done
  done
fi
if has exhaustive; then
  timeout 600 python3 -m pytest tests -q -m "gpu and slow" -p no:cacheprovider > "$OUT/logs/pytest_gpu_slow.log" 2>&1
  summary "pytest gpu slow rc=$? $(tail -1 "$OUT/logs/pytest_gpu_slow.log")"
  python3 benchmarks/codec_exhaustive.py --out "$OUT/results" > "$OUT/logs/codec_exhaustive.log" 2>&1
  summary "codec_exhaustive rc=$?"
fi
if has bench; then
  for b in ${BENCHES:-benchmarks/bench_*.py}; do
    timeout "${BENCH_TIMEOUT:-150}" python3 "$b" --out "$OUT/results" > "$OUT/logs/$(basename "$b" .py).log" 2>&1
    summary "$b rc=$?"
  done
fi
tar czf "$OUT/logs.tgz" -C "$OUT" logs && rm -rf "$OUT/logs"
tar czf "$OUT/results.tgz" -C "$OUT" results && rm -rf "$OUT/results"
cat "$OUT/summary.txt"
