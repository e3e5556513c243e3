#!/usr/bin/env bash
# Issue 17 sparse prefill: everything one device call needs (the device tool), < 230 s on an H200.
#   DSV4_BENCH_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/sparse_prefill_session.sh
# 1. the GPU tests of tests/test_sparse_prefill_v3.py with DISABLE_MMA_V3=1 (every tl.dot as
#    mma.sync, the instruction sm_80/86 run); 2. the benchmark the same way (the table that
#    counts); 3. the 64-row head groups again with triton's default (wgmma on sm_90), for the
#    record (H = 64 only). Results, logs and the TTGIR of every compiled prefill kernel (triton of
#    the machine: buffer counts, warp layouts, registers) land in $OUT/sparse_prefill.tgz, the
#    summary in $OUT/summary.txt.
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
R="$OUT/sp"
mkdir -p "$R"
export PYTHONUNBUFFERED=1 DSV4_AMPERE_IMPL=portable
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
python3 -m pip install --no-deps --no-build-isolation -e . -q > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
summary "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"
# -v: one line a test as it ends (a timed-out run still shows which passed); TEST_K deselects
# (default: the torch.compile test, the slowest and unchanged by kernel work).
DISABLE_MMA_V3=1 timeout "${TEST_TIMEOUT:-85}" python3 -m pytest tests/test_sparse_prefill_v3.py -v -m gpu -p no:cacheprovider \
  -k "${TEST_K:-not torch_compile}" > "$R/pytest_gpu.log" 2>&1
summary "pytest gpu (DISABLE_MMA_V3=1) rc=$? $(tail -1 "$R/pytest_gpu.log")"
grep -cE " PASSED" "$R/pytest_gpu.log" | sed 's/^/passed lines: /' | tee -a "$OUT/summary.txt"
grep -E "(FAILED|ERROR)" "$R/pytest_gpu.log" | head -20 | tee -a "$OUT/summary.txt"
DISABLE_MMA_V3=1 timeout "${BENCH_TIMEOUT:-90}" python3 benchmarks/bench_sparse_prefill.py --out "$R" > "$R/bench.log" 2>&1
summary "bench (DISABLE_MMA_V3=1) rc=$?"
SPARSE_PREFILL_A100_SMEM=0 SPARSE_PREFILL_BH=64 SPARSE_PREFILL_H=64 SPARSE_PREFILL_NAME=sparse_prefill_wgmma timeout "${WGMMA_TIMEOUT:-30}" \
  python3 benchmarks/bench_sparse_prefill.py --out "$R" > "$R/bench_wgmma.log" 2>&1
summary "bench wgmma (bh64 only) rc=$?"
python3 - "$R" <<'PY' | tee -a "$OUT/summary.txt"
import json, os, sys
for name in ("sparse_prefill", "sparse_prefill_wgmma"):
    path = os.path.join(sys.argv[1], name + ".json")
    if not os.path.exists(path):
        print(name, "missing"); continue
    d = json.load(open(path))
    print(name, d["meta"].get("gpu"), d["meta"].get("triton"))
    for r in d["rows"]:
        f = lambda k, fmt="{:.3g}": fmt.format(r[k]) if isinstance(r.get(k), float) else "-"
        print(r["workload"], r["H"], r["kernel"], r.get("config", ""), "us", f("us", "{:.0f}"), "xflop", f("x_flop_floor"),
              "xbyte", f("x_byte_floor"), "vs_old", f("speedup_vs_old"), "diff", f("rel_diff_vs_old"), r.get("error", "")[:80])
PY
cat "$R"/sparse_prefill_compiled/summary.txt 2>/dev/null | cut -c1-400 | tee -a "$OUT/summary.txt"
tar czf "$OUT/sparse_prefill.tgz" -C "$OUT" sp && rm -rf "$R"
cat "$OUT/summary.txt"
