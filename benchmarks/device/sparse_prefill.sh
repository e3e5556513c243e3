#!/usr/bin/env bash
# Issue 17 sparse prefill: everything one device call needs (the device tool), < 230 s on an H200.
#   DSV4_BENCH_COMMIT=$(git rev-parse --short HEAD) bash benchmarks/device/sparse_prefill.sh
# 1. the GPU tests of tests/test_sparse_prefill.py with DISABLE_MMA_V3=1 (every tl.dot as
#    mma.sync, the instruction sm_80/86 run); 2. the benchmark the same way (the table that
#    counts); 3. the 64-row head groups again with triton's default (wgmma on sm_90), for the
#    record (H = 64 only). Results, logs and the TTGIR of every compiled prefill kernel (triton of
#    the machine: buffer counts, warp layouts, registers) land in $OUT/sparse_prefill.tgz, the
#    summary in $OUT/summary.txt.
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
R="${SP_WORK:-/tmp/sp_work}/sp"  # outside $OUT: $OUT only ever holds summary.txt and the tarball
rm -rf "$R" && mkdir -p "$R" "$OUT"
export PYTHONUNBUFFERED=1 DSV4_AMPERE_IMPL=portable
summary() { echo "$*" | tee -a "$OUT/summary.txt"; }
pack() { tar czf "$OUT/sparse_prefill.tgz" -C "$(dirname "$R")" sp; }  # after every stage: a killed run keeps its files
python3 -m pip install --no-deps --no-build-isolation -e . -q > "$R/install.log" 2>&1 || { cat "$R/install.log"; exit 1; }
summary "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"
# -v: one line a test as it ends (a timed-out run still shows which passed); TEST_K deselects
# (default: the torch.compile test, the slowest and unchanged by kernel work).
DISABLE_MMA_V3=1 timeout "${TEST_TIMEOUT:-85}" python3 -m pytest tests/test_sparse_prefill.py -v -m gpu -p no:cacheprovider \
  -k "${TEST_K:-not torch_compile}" > "$R/pytest_gpu.log" 2>&1
summary "pytest gpu (DISABLE_MMA_V3=1) rc=$? $(tail -1 "$R/pytest_gpu.log")"
grep -cE " PASSED" "$R/pytest_gpu.log" | sed 's/^/passed lines: /' | tee -a "$OUT/summary.txt"
grep -E "(FAILED|ERROR)" "$R/pytest_gpu.log" | head -20 | tee -a "$OUT/summary.txt"
pack
DISABLE_MMA_V3=1 timeout "${BENCH_TIMEOUT:-90}" python3 benchmarks/bench_sparse_prefill.py --out "$R" > "$R/bench.log" 2>&1
summary "bench (DISABLE_MMA_V3=1) rc=$?"
pack
# env -u: the wgmma pass must not inherit a DISABLE_MMA_V3 exported by the caller (it did once:
# the 16:21 run of 2026-12-01 timed this pass with mma.sync, and its table was discarded).
env -u DISABLE_MMA_V3 SPARSE_PREFILL_A100_SMEM=0 SPARSE_PREFILL_BH=64 SPARSE_PREFILL_H=64 SPARSE_PREFILL_NAME=sparse_prefill_wgmma timeout "${WGMMA_TIMEOUT:-30}" \
  python3 benchmarks/bench_sparse_prefill.py --out "$R" > "$R/bench_wgmma.log" 2>&1
summary "bench wgmma (bh64 only) rc=$?"
pack
# Nsight Compute on the fastest 2-D and split-d configs at H = 64 (if the run has time left:
# NCU_AFTER_S, default 175 s since the start): smem wavefronts / bank conflicts, tensor-pipe
# activity, L2 bytes, warp stall reasons, occupancy.
if [ "$SECONDS" -lt "${NCU_AFTER_S:-175}" ] && [ -f "$R/sparse_prefill.json" ] && command -v ncu > /dev/null; then
  for c in $(python3 benchmarks/sparse_prefill_ncu.py --pick "$R/sparse_prefill.json"); do
    DISABLE_MMA_V3=1 timeout "${NCU_TIMEOUT:-25}" ncu --clock-control none -k regex:sparse_mla_prefill --launch-skip 1 \
      --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats \
      --metrics l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_elapsed,lts__t_bytes.sum,smsp__inst_executed_op_ldsm.sum \
      python3 benchmarks/sparse_prefill_ncu.py --config "$c" > "$R/ncu_${c/,/_}.txt" 2>&1
    summary "ncu config $c rc=$? ($(grep -c . "$R/ncu_${c/,/_}.txt") lines)"
    grep -E "Duration|Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Warp Cycles Per|l1tex__|sm__pipe|lts__t_bytes|smsp__inst" \
      "$R/ncu_${c/,/_}.txt" | sed 's/  */ /g' | head -30 | tee -a "$OUT/summary.txt"
  done
else
  summary "ncu skipped (elapsed ${SECONDS}s)"
fi
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
pack && rm -rf "$R"
