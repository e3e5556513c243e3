#!/usr/bin/env bash
# The end-to-end test on the H200 (device tool): vLLM 0.33.0's Python sources and ~19 small
# wheels the image lacks travel in the ignored folder .e2e_bundle/ (built on the CPU machine by
# tests/e2e/make_bundle.sh; never committed), then the GPU tests of tests/e2e/test_e2e.py (V4 /
# V4.1) and test_e2e_v32.py (V3.2 / GLM-5) run their drivers with every tensor on CUDA and the
# plugin's portable kernels. Writes under $OUT.
#   usage: bash tests/e2e/gpu_run.sh            (carry .e2e_bundle; E2E_FILES, E2E_K: a pytest -k filter, E2E_ARGS: more pytest arguments, e.g. -n 4, E2E_TIMEOUT)
set -u -o pipefail
B=.e2e_bundle
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target /tmp/e2e_site "$B"/whl/*.whl > /dev/null 2>&1 || exit 1
python3 -m pip install -q --no-deps --no-build-isolation -e . > /dev/null 2>&1 || exit 1
python3 -c "import tarfile; tarfile.open('$B/vllm_py.tar.xz').extractall('/tmp/e2e_vllm')" || exit 1
export PYTHONPATH=/tmp/e2e_site:/tmp/e2e_vllm PYTHONUNBUFFERED=1
export DSV4_E2E_AUDIT_JSON="$PWD/$B/audit.json" DSV4_E2E_AUDIT_JSON_V32="$PWD/$B/audit_v32.json" DSV4_E2E_REPORT_DIR="$OUT"
timeout "${E2E_TIMEOUT:-400}" python3 -m pytest -q -p no:cacheprovider ${E2E_FILES:-tests/e2e/test_e2e.py tests/e2e/test_e2e_v32.py} \
  -m gpu ${E2E_K:+-k "$E2E_K"} ${E2E_ARGS:-} 2>&1 | tail -40
