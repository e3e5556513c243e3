# Sourced by the device scripts (benchmarks/device/decode_paged_f16dot.sh, decode_paged_verify.sh): $OUT with logs/
# and results/, the portable path with every tl.dot as mma.sync (what sm_80 runs), the package
# installed in place, summary() appending to $SUMMARY and printing, t0 for elapsed seconds.
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT/logs" "$OUT/results"
export PYTHONUNBUFFERED=1 DSV4_AMPERE_IMPL=portable DISABLE_MMA_V3=1
SUMMARY="${SUMMARY:-$OUT/summary.txt}"
summary() { echo "$*" | tee -a "$SUMMARY"; }
t0=$(date +%s)
python3 -m pip install --no-deps --no-build-isolation -e . -q > "$OUT/logs/install.log" 2>&1 || { cat "$OUT/logs/install.log"; exit 1; }
summary "$(python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())')"
