#!/usr/bin/env bash
# The end-to-end test on the H200 (device tool): vLLM 0.33.0's Python sources and ~19 small
# wheels the image lacks travel in the ignored folder .e2e_bundle/ (built on the CPU machine by
# tests/e2e/make_bundle.sh; never committed), then the driver runs with every tensor on CUDA and
# the plugin's real portable kernels.   usage: bash tests/e2e/gpu_run.sh   (writes under $OUT)
set -u -o pipefail
B=.e2e_bundle
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/e2e_site "$B"/whl/*.whl || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
python3 -c "import tarfile; tarfile.open('$B/vllm_py.tar.xz').extractall('/tmp/e2e_vllm')" || exit 1
export PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm PYTHONUNBUFFERED=1
export DSV4_E2E_AUDIT_JSON="$B/audit.json"
python3 tests/e2e/driver.py --device cuda --out "$OUT/e2e_v41_cuda.json" 2>&1 | grep -v "^W1201" | tail -60
