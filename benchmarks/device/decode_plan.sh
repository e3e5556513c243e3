#!/usr/bin/env bash
# Issue 44 item 4 in one device call: the decode the plugin calls at 132, 112 and 104 SMs of the H200 / H100
# (driver green contexts, portable, every tl.dot as mma.sync), P2 beside where DSV4_P2_DIR holds its
# attention.py (never committed), every output checked against float64:
#   A: benchmarks/device/decode_sms.sh over T in {1, 4, 16, 64, 128, 256} x H in {8, 16, 64, 128} at K = 512 + 128,
#      then V4.1's draft K = 128 + 128 at T in {64, 128, 256} x H in {8, 16, 64, 128} (floors in every row);
#   B: benchmarks/device/decode_ragged.sh (full / ragged / even batches) at 132 and 104 SMs.
# usage: bash benchmarks/device/decode_plan.sh   env: SMS_BUDGET_S (380), RAGGED_TIMEOUT (90), DSV4_P2_DIR.
# Results: $OUT/sms/results.tgz, $OUT/ragged/results.tgz (+ logs.tgz each).
set -u -o pipefail
OUT="${OUT:-/tmp/dsv4_out}"
here="$(dirname "$0")"
K640=$(for T in 1 4 16 64 128 256; do for H in 8 16 64 128; do printf "%s:%s:512," $T $H; done; done)
K256=$(for T in 64 128 256; do for H in 8 16 64 128; do printf "%s:%s:128," $T $H; done; done)
SHAPES="${SHAPES:-${K640}${K256%,}}"
OUT="$OUT/sms" SHAPES="$SHAPES" NAME=decode_plan_sms BENCH_BUDGET_S="${SMS_BUDGET_S:-380}" SKIP_SELFCHECK=1 \
  bash "$here/decode_sms.sh"
OUT="$OUT/ragged" NAME=decode_plan_ragged BENCH_TIMEOUT="${RAGGED_TIMEOUT:-90}" bash "$here/decode_ragged.sh"
