#!/usr/bin/env bash
# The eager decode step's host cost with kept plans (issue 28 item 4) in one device call (< 120 s):
#   A: benchmarks/bench_host_cost.py --quick (plugin entry, composite, ops, floors; T in {1, 4} x H in
#      {8, 64}; eager, slow-launch and graph us) into $OUT/results/host_cost.{json,md};
#   B: the GPU tests of the kept plans and the host-cost path (tests/test_decode_step_plan.py: eager +
#      captured graph against float64; tests/test_host_cost.py -m gpu: direct launches, kept / replayed).
# usage: bash benchmarks/device/host_cost_plan.sh   env: DSV4_BENCH_COMMIT, T_BENCH (60), T_TESTS (45).
source "$(dirname "$0")/preamble.sh"
timeout "${T_BENCH:-60}" python3 benchmarks/bench_host_cost.py --quick --out "$OUT/results" > "$OUT/logs/bench.log" 2>&1
summary "bench rc=$? at $(( $(date +%s) - t0 )) s"
grep -E "^\| portable \| 1 \| 8 \| (step|floor: torch.empty)" "$OUT/results/host_cost.md" | tee -a "$SUMMARY"
timeout "${T_TESTS:-45}" python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_decode_step_plan.py \
  tests/test_host_cost.py > "$OUT/logs/pytest_gpu.log" 2>&1
summary "tests rc=$? $(tail -1 "$OUT/logs/pytest_gpu.log") at $(( $(date +%s) - t0 )) s"
