#!/usr/bin/env bash
# Build .e2e_bundle/ (ignored, never committed) for tests/e2e/gpu_run.sh: vLLM 0.33.0's Python
# sources (from `pip download`), the cp312 wheels the H200 image lacks, and the audits' JSON.
# E2E_BUNDLE: another (ignored) folder, e.g. the engine run's carry folder (tests/e2e/engine/device.sh).
set -euo pipefail
cd "$(dirname "$0")/../.."
B="${E2E_BUNDLE:-.e2e_bundle}"; mkdir -p "$B/whl" "$B/dl"
python3 -m pip download -q --no-deps vllm==0.33.0 -d "$B/dl"
python3 - "$B" <<'PY'
import io, sys, tarfile, zipfile, glob
b = sys.argv[1]
z = zipfile.ZipFile(glob.glob(f"{b}/dl/vllm-0.33.0-*.whl")[0])
with tarfile.open(f"{b}/vllm_py.tar.xz", "w:xz") as t:
    for nm in z.namelist():
        if (nm.startswith("vllm/") and nm.endswith(".py")) or nm.endswith(("dist-info/METADATA", "dist-info/entry_points.txt")):
            data = z.read(nm); ti = tarfile.TarInfo(nm); ti.size = len(data); t.addfile(ti, io.BytesIO(data))
PY
rm -rf "$B/dl"
P=""; for n in 17 24 27 28 31 34 35 39; do P="$P --platform manylinux_2_${n}_x86_64"; done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
  --platform manylinux2014_x86_64 --platform any -d "$B/whl" pydantic==2.13.4 pydantic_core==2.46.4 \
  annotated-types==0.7.0 typing-inspection==0.4.2 cbor2==6.3.0 pyzmq==27.3.0 msgspec==0.23.0 pybase64==1.5.1 \
  cachetools==8.0.2 openai==3.57.0 httpx2==2.16.2 sniffio==1.3.1 oss-harmony==0.0.11 xgrammar==0.2.8 \
  apache-tvm-ffi==0.1.11 llguidance==1.7.6 fastapi==0.136.3 starlette==1.10.0 partial-json-parser==0.2.1.1.post7
# the engine run (tests/e2e/engine): the model loader's quantization imports (compressed-tensors,
# loguru), torch.compile's depyf, prefix-cache hashing and `vllm serve`'s server stack
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $P \
  --platform manylinux2014_x86_64 --platform any -d "$B/whl" compressed-tensors==0.17.0 loguru==0.7.3 \
  depyf==0.20.0 astor==0.8.1 dill==0.4.1 blake3==1.0.11 orjson==3.13.0 prometheus-fastapi-instrumentator==8.1.0 \
  uvicorn==0.54.0 setproctitle==1.3.8 python-json-logger==4.2.0 ijson==3.6.0 lark==1.2.2 jsonschema==4.26.0 \
  jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 model-hosting-container-standards==0.1.16 \
  watchfiles==1.3.0 python-multipart==0.0.34 jmespath==1.1.0 supervisor==4.3.0
# transformers: the V3.2 / GLM-5 oracle's modeling code (the image's 5.17 predates the version the test extra pins)
python3 -m pip download -q --no-deps --only-binary=:all: -d "$B/whl" transformers==5.20.2
dsv4-ops audit-vllm --model both --json > "$B/audit.json"
python3 -c "from dsv4_ops.vllm import audit; audit.run(models=('v32', 'glm5'), cache='$B/audit_v32.json')" > /dev/null
