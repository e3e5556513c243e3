#!/usr/bin/env bash
# CPU machine: fill the ignored carry folder for tests/e2e/engine/device.sh (never committed):
# the repo's working tree, bundle/ (tests/e2e/make_bundle.sh with E2E_BUNDLE) and
# bundle/manifest.json (tests/e2e/engine/checkpoints.py --verify, which also proves vLLM's loader
# reads the three checkpoints) and bundle/first_token.json (first_token.py: check (b)). Then: run `cd .devcarry/<name> && bash tests/e2e/engine/device.sh`
# with carry [".devcarry/<name>"].
#   usage: bash tests/e2e/engine/prepare_carry.sh /work/main/.devcarry/<name> [--skip-bundle]
#   E2E_VLLM: the vLLM release to carry (default: the newest supported); E2E_VLLM_WHEEL,
#   E2E_VLLM_PYTHONPATH: as tests/e2e/make_bundle.sh (the manifest is built and verified with the
#   same release's model classes and loader, so it imports that release too)
set -euo pipefail
DEST=$1; SRC="$(cd "$(dirname "$0")/../../.." && pwd)"
V="${E2E_VLLM:-$(cd "$SRC" && python3 -c 'from dsv4_ops.vllm import versions; print(versions.SUPPORTED[-1])')}"
export E2E_VLLM="$V"
mkdir -p "$DEST/bundle"
# the working tree as the device tool sends it: tracked files and untracked ones git does not ignore
(cd "$SRC" && git ls-files -z --cached --others --exclude-standard | while IFS= read -r -d '' f; do
  [ -f "$f" ] && printf '%s\0' "$f"; done | xargs -0 cp --parents -t "$DEST")
if [ "${2:-}" != "--skip-bundle" ]; then E2E_BUNDLE="$DEST/bundle" bash "$SRC/tests/e2e/make_bundle.sh"; fi
VP="${E2E_VLLM_PYTHONPATH:-}"
if [ -z "$VP" ] && [ -d "$SRC/.ci/vllm-$V" ]; then VP="$SRC/.ci/vllm-$V"; fi
if [ -n "$VP" ]; then export PYTHONPATH="$VP${PYTHONPATH:+:$PYTHONPATH}"; fi
GOT=$(python3 -c "from importlib.metadata import version; print(version('vllm'))")
[ "$GOT" = "$V" ] || { echo "prepare_carry: vLLM $GOT would build the manifest, not $V: set E2E_VLLM_PYTHONPATH" >&2; exit 1; }
# the manifest holds vLLM's parameter list, which moves between releases (0.34.0: DSpark's
# context_wkv_proj): rebuilt when it was made for another release
if [ "$(cat "$DEST/bundle/manifest.vllm" 2>/dev/null)" != "$V" ]; then rm -f "$DEST/bundle/manifest.json" "$DEST/bundle/first_token.json"; fi
if [ ! -f "$DEST/bundle/manifest.json" ]; then
  T=$(mktemp -d); python3 "$SRC/tests/e2e/engine/checkpoints.py" "$T" v41 v41x v4 v32 --verify
  cp "$T/manifest.json" "$DEST/bundle/manifest.json"; echo "$V" > "$DEST/bundle/manifest.vllm"
fi
if [ ! -f "$DEST/bundle/first_token.json" ]; then   # check (b): the float64 first tokens (first_token.py)
  T=$(mktemp -d); python3 "$SRC/tests/e2e/engine/checkpoints.py" "$T" v4 v32 --from-manifest "$DEST/bundle/manifest.json"
  python3 "$SRC/tests/e2e/engine/first_token.py" "$T" "$DEST/bundle/first_token.json" v4 v32 v32_fp8
fi
du -sh "$DEST"
