"""Write the shipped decode tables (dsv4_ops/tables/) from sweeps already measured with
benchmarks/bench_decode_sms.py --sweep: one table per SM count, each entry the fastest dispatched
candidate the composite may run (dsv4_ops.tools.tune.from_sweep_rows), "source" naming the files and
the commits they were measured at. Only measured shapes get an entry; the rest keep the cost model.

    python benchmarks/tables_from_sweeps.py [--out dsv4_ops/tables] [--sms 132,112,104] SWEEP.json ...

``dsv4-ops tune`` writes the same tables from a fresh measurement (and should replace these).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from dsv4_ops import envs  # noqa: E402
from dsv4_ops.tools import tune  # noqa: E402

DEFAULT_SWEEPS = ("benchmarks/results/decode_sms_call1.json", "benchmarks/results/decode_sms_heads.json")
H200_SMEM = 227 * 1024  # an H200's shared memory a block (where the sweeps ran)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sweeps", nargs="*", default=list(DEFAULT_SWEEPS))
    ap.add_argument("--out", default=os.path.join(ROOT, "dsv4_ops", "tables"))
    ap.add_argument("--sms", default="132,112,104")
    ap.add_argument("--smem", type=int, default=H200_SMEM)
    ns = ap.parse_args()
    head = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    loaded = [(path, json.load(open(os.path.join(ROOT, path)))) for path in ns.sweeps]
    gpus = {d["meta"]["gpu"] for _, d in loaded}
    variants = {d["meta"].get("impl", "portable") for _, d in loaded}
    if len(gpus) != 1 or len(variants) != 1:
        raise SystemExit(f"the sweeps must come from one device and variant, got {gpus} / {variants}")
    made = "; ".join(f"{p} (commit {d['meta']['commit']}, {d['meta']['date']}, {d['meta'].get('gpu')}, {d.get('notes', '').split(', SMs')[0]})"
                     for p, d in loaded)
    gpu, variant = gpus.pop(), variants.pop()
    rows = [r for _, d in loaded for r in d["rows"]]
    source = (f"converted by benchmarks/tables_from_sweeps.py at commit {head} from the sweeps {made}: dispatched "
              f"configs x balanced splits within the composite's partials cap; not a tune run")
    with envs.override(**{envs.DECODE_TABLES: "0"}):
        for sms in (int(x) for x in ns.sms.split(",")):
            results = tune.from_sweep_rows(rows, sms, ns.smem)
            table = tune.build_table(results, gpu, sms, variant, source, ns.smem, ns.sweeps)
            path = tune.write_table(table, ns.out)
            print(f"{os.path.relpath(path, ROOT)}: {sum(len(v) for v in table['entries'].values())} shapes")
            print(tune.summary(results, sms))


if __name__ == "__main__":
    main()
