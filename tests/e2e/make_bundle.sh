#!/usr/bin/env bash
# Build .e2e_bundle/ (ignored, never committed) for tests/e2e/gpu_run.sh and the engine run
# (tests/e2e/engine/device.sh): one supported vLLM release's Python sources (from its wheel), the
# cp312 wheels the H200 image lacks, and the audits' JSON for that release.
#   E2E_VLLM: the vLLM release (default: the newest of dsv4_ops.vllm.versions.SUPPORTED), e.g. 0.33.0
#   E2E_VLLM_WHEEL: that release's wheel already on disk (else `pip download --no-deps vllm==$E2E_VLLM`)
#   E2E_VLLM_PYTHONPATH: where that release imports from on this machine, when it is not the
#     installed vLLM (the audits import it); default .ci/vllm-$E2E_VLLM when that exists
#     (`python -m dsv4_ops.tools.install_vllm $E2E_VLLM --target .ci/vllm-$E2E_VLLM`)
#   E2E_BUNDLE: another (ignored) folder, e.g. the engine run's carry folder (tests/e2e/engine/prepare_carry.sh)
set -euo pipefail
cd "$(dirname "$0")/../.."
V="${E2E_VLLM:-$(python3 -c 'from dsv4_ops.vllm import versions; print(versions.SUPPORTED[-1])')}"
python3 -c "import sys; from dsv4_ops.vllm import versions; sys.exit(0 if '$V' in versions.SUPPORTED else 'E2E_VLLM=$V: not a supported vLLM release ' + str(versions.SUPPORTED))"
# where release $V imports from here (the audits read it): checked before anything is downloaded
IV=$(python3 -c "from importlib.metadata import version; print(version('vllm'))" 2>/dev/null || true)
VP="${E2E_VLLM_PYTHONPATH:-}"
if [ -z "$VP" ] && [ "$IV" != "$V" ] && [ -d ".ci/vllm-$V" ]; then VP="$PWD/.ci/vllm-$V"; fi
VPP="${VP:+$VP${PYTHONPATH:+:}}${PYTHONPATH:-}"
GOT=$(PYTHONPATH="$VPP" python3 -c "from importlib.metadata import version; print(version('vllm'))" 2>/dev/null || true)
[ "$GOT" = "$V" ] || { echo "make_bundle: vLLM $V does not import here (found '${GOT}'): set E2E_VLLM_PYTHONPATH" >&2; exit 1; }
B="${E2E_BUNDLE:-.e2e_bundle}"; mkdir -p "$B/whl" "$B/dl"
rm -f "$B/dl"/vllm-*.whl
if [ -n "${E2E_VLLM_WHEEL:-}" ]; then cp "$E2E_VLLM_WHEEL" "$B/dl/"; else python3 -m pip download -q --no-deps "vllm==$V" -d "$B/dl"; fi
python3 - "$B" "$V" <<'PY'
import io, sys, tarfile, zipfile, glob
b, v = sys.argv[1:3]
z = zipfile.ZipFile(glob.glob(f"{b}/dl/vllm-{v}-*.whl")[0])
with tarfile.open(f"{b}/vllm_py.tar.xz", "w:xz") as t:
    for nm in z.namelist():
        if (nm.startswith("vllm/") and nm.endswith(".py")) or nm.endswith(("dist-info/METADATA", "dist-info/entry_points.txt")):
            data = z.read(nm); ti = tarfile.TarInfo(nm); ti.size = len(data); t.addfile(ti, io.BytesIO(data))
PY
echo "$V" > "$B/vllm_version.txt"   # device.sh checks the unpacked sources against it
rm -rf "$B/dl"
# the wheels (the same set serves 0.33.0 and 0.34.0: their requirement lists differ only in pins
# of packages the image has or that never load on this path)
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
# the audits, read from the same release's source ($VPP above)
PYTHONPATH="$VPP" python3 -m dsv4_ops.tools.cli audit-vllm --model both --json > "$B/audit.json" \
  || { [ -s "$B/audit.json" ] && echo "make_bundle: vLLM $V's audit has open rows (audit.json written; the tripwire reads it)" >&2; }
PYTHONPATH="$VPP" python3 -c "from dsv4_ops.vllm import audit; audit.run(models=('v32', 'glm5'), cache='$B/audit_v32.json')" > /dev/null
