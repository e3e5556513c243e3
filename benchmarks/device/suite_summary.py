"""Summary of one GPU-suite call (benchmarks/device/gpu_suite.sh): the collected node ids against
the outcomes tests/conftest.py wrote (DSV4_TEST_OUTCOMES), as passed / failed / skipped / not
reached, with the ids of every test that did not pass.
    python benchmarks/device/suite_summary.py COLLECTED OUTCOMES [--part N] [--files ...] [--torch ...]
"""

import argparse
import collections
import os
import subprocess


def summarize(collected, outcomes):
    """collected: node ids; outcomes: (node id, outcome) lines. Returns {outcome: [ids]}, with
    'not reached' for a collected id that got no outcome. A failure in any phase wins."""
    result = {}
    for nodeid, outcome in outcomes:
        if result.get(nodeid) == "failed":
            continue
        if outcome == "failed" or nodeid not in result or result[nodeid] == "passed" and outcome == "skipped":
            result[nodeid] = outcome
    groups = collections.defaultdict(list)
    for nodeid in collected:
        groups[result.get(nodeid, "not reached")].append(nodeid)
    for nodeid, outcome in result.items():
        if nodeid not in collected:
            groups[outcome].append(nodeid)
    return groups


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("collected")
    ap.add_argument("outcomes")
    ap.add_argument("--part", default="?")
    ap.add_argument("--files", default="")
    ap.add_argument("--torch", default="")
    a = ap.parse_args()
    collected = [ln.strip() for ln in open(a.collected) if "::" in ln]
    outcomes = []
    for ln in open(a.outcomes):
        nodeid, _, outcome = ln.rstrip("\n").rpartition(" ")
        if nodeid:
            outcomes.append((nodeid, outcome))
    groups = summarize(collected, outcomes)
    # the device copy's git metadata may be older than its files, so git's HEAD is only a hint
    commit = os.environ.get("SUITE_COMMIT", "")
    if not commit:
        try:
            head = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
        except Exception:  # noqa: BLE001
            head = "?"
        commit = f"unknown: SUITE_COMMIT not set; git HEAD here {head}, possibly stale"
    print(f"GPU suite part {a.part} (commit {commit}; {a.torch})")
    print(f"files: {a.files}")
    print(f"collected {len(collected)}: " + ", ".join(f"{k} {len(groups.get(k, []))}"
                                                      for k in ("passed", "failed", "skipped", "not reached")))
    for k in ("failed", "not reached", "skipped"):
        for nodeid in groups.get(k, []):
            print(f"{k}: {nodeid}")


if __name__ == "__main__":
    main()
