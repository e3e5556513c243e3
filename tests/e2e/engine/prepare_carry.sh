#!/usr/bin/env bash
# CPU machine: fill the ignored carry folder for tests/e2e/engine/device.sh (never committed):
# the repo's working tree, bundle/ (tests/e2e/make_bundle.sh with E2E_BUNDLE) and
# bundle/manifest.json (tests/e2e/engine/checkpoints.py --verify, which also proves vLLM's loader
# reads the three checkpoints) and bundle/first_token.json (first_token.py: check (b)). Then: run `cd .devcarry/<name> && bash tests/e2e/engine/device.sh`
# with carry [".devcarry/<name>"].
#   usage: bash tests/e2e/engine/prepare_carry.sh /work/main/.devcarry/<name> [--skip-bundle]
set -euo pipefail
DEST=$1; SRC="$(cd "$(dirname "$0")/../../.." && pwd)"
mkdir -p "$DEST/bundle"
(cd "$SRC" && git ls-files -z | xargs -0 cp --parents -t "$DEST")   # tracked files only
if [ "${2:-}" != "--skip-bundle" ]; then E2E_BUNDLE="$DEST/bundle" bash "$SRC/tests/e2e/make_bundle.sh"; fi
if [ ! -f "$DEST/bundle/manifest.json" ]; then
  T=$(mktemp -d); python "$SRC/tests/e2e/engine/checkpoints.py" "$T" v41 v41x v4 v32 --verify
  cp "$T/manifest.json" "$DEST/bundle/manifest.json"
fi
if [ ! -f "$DEST/bundle/first_token.json" ]; then   # check (b): the float64 first tokens (first_token.py)
  T=$(mktemp -d); python "$SRC/tests/e2e/engine/checkpoints.py" "$T" v4 v32
  python "$SRC/tests/e2e/engine/first_token.py" "$T" "$DEST/bundle/first_token.json" v4 v32 v32_fp8
fi
du -sh "$DEST"
