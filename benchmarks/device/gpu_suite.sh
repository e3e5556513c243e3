#!/usr/bin/env bash
# The whole GPU suite (pytest -m "gpu and not slow") in two device calls: a stable split by file.
#   usage: bash benchmarks/device/gpu_suite.sh 1|2        (one call each, at most 8 min on an H200)
# Part 1: the paged and heads decode files listed below (~340 cases, the heaviest). Part 2: every other
# test file that holds a GPU test (the complement, so a new file is never left out). Each part needs
# most of a call: at 50df002 (H200, 16 workers) part 1 ran 384 tests in 477 s, part 2 601 in 422 s
# (benchmarks/results/gpu_suite.md), so neither shares a call with other work. Pass SUITE_COMMIT
# (the summary's label; the device copy's git metadata may be older than its files).
# Each part writes $OUT/suite_part<N>.txt:
# passed / failed / skipped / not reached (collected but given no result before the time cap),
# with the node ids of every test that did not pass, and $OUT/suite_part<N>.log (pytest's output).
# env: SUITE_TIMEOUT (seconds for pytest, default 500), SUITE_WORKERS (xdist workers, default 16; 0: none),
#      PYTEST_ARGS (extra pytest arguments), SUITE_ONLY (a file of node ids: run just those, e.g. the
#      "not reached" of an earlier call; the summary then counts them alone).
set -u -o pipefail
PART="${1:?usage: gpu_suite.sh 1|2}"
OUT="${OUT:-/tmp/dsv4_out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PART1="tests/test_decode_paged.py tests/test_decode_heads.py"
python3 -m pip install --no-deps --no-build-isolation -e . -q > "$OUT/install_part$PART.log" 2>&1 || { cat "$OUT/install_part$PART.log"; exit 1; }
ALL=$(grep -rlE "pytest\.mark\.gpu|mark\.gpu" tests --include='test_*.py' | sort)
if [ "$PART" = 1 ]; then FILES=$(echo $PART1); else FILES=$(comm -23 <(echo "$ALL") <(echo "$PART1" | tr ' ' '\n' | sort) | tr '\n' ' '); fi
IDS="$OUT/collected_part$PART.txt"; LOG="$OUT/suite_part$PART.log"
if [ -n "${SUITE_ONLY:-}" ]; then grep "::" "$SUITE_ONLY" | sed 's/^not reached: //' > "$IDS"; FILES=$(tr '\n' ' ' < "$IDS")
else python3 -m pytest $FILES -q --collect-only -m "gpu and not slow" -p no:cacheprovider 2>/dev/null | grep "::" > "$IDS"; fi
export DSV4_TEST_OUTCOMES="$OUT/outcomes_part$PART.txt"; : > "$DSV4_TEST_OUTCOMES"
timeout "${SUITE_TIMEOUT:-500}" python3 -m pytest $FILES -q -m "gpu and not slow" -p no:cacheprovider \
  --durations=40 $( [ "${SUITE_WORKERS:-16}" != 0 ] && echo "-n ${SUITE_WORKERS:-16}" ) ${PYTEST_ARGS:-} > "$LOG" 2>&1
echo "pytest rc=$?" >> "$LOG"
python3 benchmarks/device/suite_summary.py "$IDS" "$DSV4_TEST_OUTCOMES" --part "$PART" --files "$FILES" \
  --torch "$(python3 -c 'import torch, triton; print(torch.__version__, triton.__version__, torch.cuda.get_device_name())')" \
  > "$OUT/suite_part$PART.txt"
cat "$OUT/suite_part$PART.txt"; tail -3 "$LOG"
