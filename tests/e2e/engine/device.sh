#!/usr/bin/env bash
# The engine run on the device (H200), one call: install the carried bundle, run
# tests/e2e/engine/run_engine.py once per entry of E2E_RUNS, write $OUT/SUMMARY.md.
#
# Carry layout (ignored folder, never committed; built on the CPU machine by
# tests/e2e/engine/prepare_carry.sh): the repo (worktree copy) with bundle/ (vllm_py.tar.xz,
# whl/*.whl, audit.json, audit_v32.json: tests/e2e/make_bundle.sh; manifest.json:
# tests/e2e/engine/checkpoints.py), from which the checkpoints are rewritten here (E2E_MODELS).
#   E2E_RUNS: space-separated NAME=MODEL:MODE[:SPEC_METHOD:K][:serve|:serveonly][:mutate][:nojit][:fixedkv], e.g.
#     "v41e=v41:eager v41g=v41:graphs v41m=v41:eager:mutate v4e=v4:eager v4m1=v4:eager:mtp:1
#      v4m5=v4:eager:mtp:5 v32e=v32:eager v41s=v41:eager:serve"
#   E2E_RUN_TIMEOUT: seconds per run (default 150); E2E_TOTAL: seconds for the whole script (default
#   480): a run gets at most what is left of it (minus 25 s for the summary), none when under 30 s;
#   E2E_EXTRA: JSON of more LLM(...) kwargs; E2E_RUNS2..E2E_RUNS6, E2E_EXTRA2, E2E_LANE2_DELAY: more lanes (below)
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"; mkdir -p "$OUT"
R=/tmp/e2e_runs; mkdir -p "$R"   # every log and report; $OUT gets SUMMARY.md, setup.txt and runs.tgz (few files come back)
B=bundle
T0=$(date +%s)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/e2e_site "$B"/whl/*.whl > "$R/pip.log" 2>&1 || { tail -5 "$R/pip.log"; exit 1; }
# E2E_USE_INSTALLED=1: dsv4_ops as already installed (e.g. by the GPU suite running beside this
# script in the same call: a second editable install would re-point it under the suite's workers)
if [ "${E2E_USE_INSTALLED:-0}" != 1 ]; then
  python3 -m pip install -q --no-deps --no-build-isolation -e . >> "$R/pip.log" 2>&1 || { tail -5 "$R/pip.log"; exit 1; }
fi
python3 -m pip install -q --no-index --no-deps --target /tmp/e2e_site "$(python3 tests/e2e/a100_platform/make_wheel.py /tmp/e2e_whl)" >> "$R/pip.log" 2>&1 || { tail -5 "$R/pip.log"; exit 1; }
python3 -c "import tarfile; tarfile.open('$B/vllm_py.tar.xz').extractall('/tmp/e2e_vllm')" || exit 1
# the release the bundle carries (tests/e2e/make_bundle.sh, E2E_VLLM): its dist-info is what vLLM and
# the plugin's version check read
VV=$(ls -d /tmp/e2e_vllm/vllm-*.dist-info | sed 's|.*/vllm-||; s|\.dist-info||')
echo "vLLM $VV (bundle: $(cat "$B/vllm_version.txt" 2>/dev/null || echo '?'))" | tee "$OUT/setup.txt"
[ ! -f "$B/vllm_version.txt" ] || [ "$(cat "$B/vllm_version.txt")" = "$VV" ] || { echo "bundle mismatch"; exit 1; }
export PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm:$PWD/tests/e2e:$PWD/tests/e2e/engine PYTHONUNBUFFERED=1
export DSV4_E2E_A100=1 DSV4_AMPERE_IMPL=portable VLLM_LOGGING_LEVEL=INFO VLLM_ALLOW_INSECURE_SERIALIZATION=1
# flashinfer is not on the image (a CUDA install of vLLM has it): vLLM's top-k/top-p sampler
# falls back to its own (greedy sampling never reaches either)
export VLLM_USE_FLASHINFER_SAMPLER=0
python3 tests/e2e/engine/prewarm_modelinfo.py > "$R/prewarm.log" 2>&1 &   # beside the checkpoint writer
PREWARM=$!
export DSV4_E2E_AUDIT_JSON="$PWD/$B/audit.json" DSV4_E2E_AUDIT_JSON_V32="$PWD/$B/audit_v32.json"
CK=/tmp/e2e_ckpt
python3 tests/e2e/engine/checkpoints.py "$CK" ${E2E_MODELS:-v41 v41x v4 v32} --from-manifest "$B/manifest.json" > "$R/ckpt.log" 2>&1 || { tail -20 "$R/ckpt.log"; exit 1; }
wait $PREWARM; echo "model-info prewarm rc=$? ($(grep -c cached "$R/prewarm.log") cached)" | tee -a "$OUT/setup.txt"
echo "setup $(( $(date +%s) - T0 )) s" | tee -a "$OUT/setup.txt"
python3 -c "
from importlib.metadata import entry_points as e
print('platform_plugins', sorted(x.value for x in e(group='vllm.platform_plugins')))
print('general_plugins', sorted(x.value for x in e(group='vllm.general_plugins')))" | tee -a "$OUT/setup.txt"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv >> "$OUT/setup.txt" 2>&1
lane() {   # $1: the runs, one after another; $2: JSON of more LLM(...) kwargs for this lane's runs
  local run name model mode a3 a4 a5 x t left lim extra fixed
  for run in $1; do
    name=${run%%=*}; IFS=: read -r model mode a3 a4 a5 <<< "${run#*=}"
    args=(--ckpt "$CK/$model" --model "$model" --mode "$mode" --out "$R/$name.json")
    envs=(); fixed=0
    for x in "${a3:-}" "${a4:-}" "${a5:-}"; do
      case "$x" in
        serve) args+=(--serve);;
        serveonly) args+=(--serve --serve-only);;   # no LLM.generate first: compared with the eager run
        nojit) args+=(--no-jit-warmup);;
        mutate) envs+=(DSV4_E2E_MUTATE=topk_off_by_one);;
        fixedkv) fixed=1;;   # the second lanes' fixed KV size for this run (a profile beside other lanes can fail)
        dspark|mtp|deepseek_mtp) args+=(--spec-method "$x");;
        [0-9]*) args+=(--spec-k "$x");;
      esac
    done
    extra=$(python3 -c "import json, sys; d = json.loads(sys.argv[1] or '{}'); d.update(json.loads(sys.argv[2] or '{}')); print(json.dumps(d) if d else '')" "${E2E_EXTRA:-}" "$( [ "$fixed" = 1 ] && echo "$X2" || echo "$2" )")
    [ -n "$extra" ] && args+=(--extra "$extra")
    t=$(date +%s); left=$(( ${E2E_TOTAL:-480} - 25 - (t - T0) )); lim=${E2E_RUN_TIMEOUT:-150}
    [ "$left" -lt 30 ] && { echo "$name skipped: ${left} s left of E2E_TOTAL" | tee -a "$OUT/setup.txt"; continue; }
    [ "$left" -lt "$lim" ] && lim=$left
    env "${envs[@]}" timeout -k 10 "$lim" python3 tests/e2e/engine/run_engine.py "${args[@]}" > "$R/$name.log" 2>&1
    echo "$name rc=$? $(( $(date +%s) - t )) s${2:+ (lane 2: $2)}" | tee -a "$OUT/setup.txt"
  done
}
# A second lane (E2E_RUNS2) runs beside the first on the same GPU, started E2E_LANE2_DELAY s later.
# Its runs get a fixed KV size (E2E_EXTRA2, vLLM's kv_cache_memory_bytes: the profile run still
# runs, its measurement is skipped) because vLLM's memory profile counts every process's growth on
# the device as its own non-torch memory; the first lane's KV sizes may come out smaller for the
# same reason (reported as measured).
X2='{"kv_cache_memory_bytes": 4294967296}'; X2=${E2E_EXTRA2:-$X2}
LANES=()
# lanes 3 to 6 likewise (E2E_RUNS3 .. E2E_RUNS6), each started one delay after the one before
for n in 2 3 4 5 6; do
  v="E2E_RUNS$n"
  if [ -n "${!v:-}" ]; then ( sleep $(( (n - 1) * ${E2E_LANE2_DELAY:-40} )); lane "${!v}" "$X2" ) & LANES+=($!); fi
done
lane "${E2E_RUNS:-v41e=v41:eager}" ""
for p in "${LANES[@]}"; do wait "$p"; done
cp "$B/first_token.json" "$R/" 2>/dev/null   # check (b)'s float64 first tokens (prepare_carry.sh)
python3 tests/e2e/engine/summary.py "$R" > "$OUT/SUMMARY.md" 2>&1; RC=$?; tail -60 "$OUT/SUMMARY.md"
tar czf "$OUT/runs.tgz" -C "$R" .
echo "total $(( $(date +%s) - T0 )) s; summary rc=$RC (1: a check failed, e.g. a mutated run did not change the output)"
exit $RC
