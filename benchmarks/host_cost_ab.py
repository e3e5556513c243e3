"""A/B of the eager decode step's Python cost between two source trees, on the CPU (no GPU needed).

    python benchmarks/host_cost_ab.py --before DIR --after DIR [--rounds 3] [--out DIR]

Runs ``benchmarks/bench_host_cost.py --mock --quick`` of each tree (``PYTHONPATH=<tree>``, its own
bench script) alternately, ``--rounds`` times each, so that a shared machine's load drifts over both
alike; each row's ``python_us`` is the median over the rounds. Writes host_cost_ab.{json,md} under
--out (default benchmarks/results) with before, after and after / before per (T, H, what).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import RESULTS_DIR, write_results  # noqa: E402


def run_mock(tree: str, out_dir: str) -> dict:
    """{(T, H, what): python_us} of one --mock --quick run of ``tree``'s bench script."""
    env = dict(os.environ, PYTHONPATH=tree)
    script = os.path.join(tree, "benchmarks", "bench_host_cost.py")
    subprocess.run([sys.executable, script, "--mock", "--quick", "--out", out_dir], env=env, check=True,
                   stdout=subprocess.DEVNULL)
    with open(os.path.join(out_dir, "host_cost_mock.json")) as f:
        rows = json.load(f)["rows"]
    return {(r["T"], r["H"], r["what"]): r.get("python_us") for r in rows}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", required=True)
    p.add_argument("--after", required=True)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=RESULTS_DIR)
    args = p.parse_args()
    runs = {"before": [], "after": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for side in ("before", "after"):
                runs[side].append(run_mock(getattr(args, side), os.path.join(tmp, f"{side}{i}")))
    rows = []
    for key in runs["after"][0]:
        b = [r[key] for r in runs["before"] if r.get(key) is not None]
        a = [r[key] for r in runs["after"] if r.get(key) is not None]
        row = {"T": key[0], "H": key[1], "what": key[2]}
        if b:
            row["before_us"] = statistics.median(b)
        if a:
            row["after_us"] = statistics.median(a)
        if a and b:
            row["after/before"] = row["after_us"] / row["before_us"]
        rows.append(row)
    write_results("host_cost_ab", args.out, rows, ["T", "H", "what", "before_us", "after_us", "after/before"],
                  notes=f"bench_host_cost.py --mock --quick of each tree, alternated, {args.rounds} rounds; median "
                        f"python_us (CPU time of the calling thread). before: {args.before}; after: {args.after}.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
