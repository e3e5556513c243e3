#!/usr/bin/env bash
# `dsv4-ops tune --quick` on N SMs of the H200 (driver green context), portable, every tl.dot as mma.sync (what
# sm_80 runs), then the table it wrote read back through the dispatch (DSV4_AMPERE_DECODE_TABLE_DIR at it):
#   A: the tune (T 1,16,64,128 x H 8,64, K 640; 75 s budget for starting shapes);
#   B: every entry of the written table is what dispatch.decode.plan_step plans at that shape and SM count.
# usage: bash benchmarks/device/tune.sh   env: SMS (104), TUNE_ARGS (extra `dsv4-ops tune` arguments)
# Results: $OUT/results/ (the table, tune_<table>.json rows for fit_v3_cost.py, tune_<table>.md, summary.txt)
# and all of it as $OUT/tune_results.tgz.
source "$(dirname "$0")/preamble.sh"
timeout 240 python3 -m dsv4_ops tune --quick --sms "${SMS:-104}" --out "$OUT/results" ${TUNE_ARGS:-} > "$OUT/logs/tune.log" 2>&1
summary "tune rc=$? at $(( $(date +%s) - t0 )) s: $(grep -E '^wrote|DROPPED|budget' "$OUT/logs/tune.log" | tr '\n' ' ')"
cp "$OUT/logs/tune.log" "$OUT/results/"
DSV4_AMPERE_SMS="${SMS:-104}" DSV4_AMPERE_DECODE_TABLE_DIR="$OUT/results" timeout 60 python3 - > "$OUT/logs/readback.log" 2>&1 <<'PY'
import glob, json, os, torch
from dsv4_ops import envs
from dsv4_ops.dispatch import decode as dd, device, tables
torch.cuda.init()
path = glob.glob(os.path.join(envs.get(envs.DECODE_TABLE_DIR), "decode,*.json"))[0]
print("table", path)
t = json.load(open(path))
bad = 0
for K, buckets in t["entries"].items():
    for key, e in buckets.items():
        T, H = (int(x) for x in key.split(","))
        p = dd.plan_step(T, H, int(K), device.num_sms(0))
        ok = (p.config, p.splits) == (e["config"], e["splits"])
        bad += not ok
        print(f"T={T} H={H} K={K}: table {e['config']} S{e['splits']}, plan_step {p.config} S{p.splits}", "ok" if ok else "MISMATCH")
print("readback", "ok" if not bad else f"{bad} MISMATCH")
PY
summary "readback rc=$?: $(tail -1 "$OUT/logs/readback.log")"
cp "$OUT/logs/readback.log" "$OUT/summary.txt" "$OUT/results/"
cat "$OUT/summary.txt"
# the table's name holds commas (vLLM's convention), which the device tool does not bring back: a tarball does
tar czf "$OUT/tune_results.tgz" -C "$OUT/results" .
