"""Compare two traced driver runs of the same seed (e.g. the CPU run and the H200 run, both with
DSV4_E2E_SEED=<n> DSV4_E2E_TRACE=1): per step and token, the logits' cosine and every discrete
choice that differs (MoE experts per layer, indexer top-k per layer).

    python tests/e2e/compare_runs.py cpu.json gpu.json
"""

from __future__ import annotations

import json
import sys

import torch


def compare(a: dict, b: dict) -> list:
    assert a["seed"] == b["seed"], "the runs must share the seed"
    rows = []
    for sa, sb in zip(a["trace"], b["trace"]):
        la, lb = torch.tensor(sa["logits"]), torch.tensor(sb["logits"])
        cos = torch.nn.functional.cosine_similarity(la.double(), lb.double(), dim=-1)
        for t in range(la.shape[0]):
            flips = []
            for kind in ("experts", "topk"):
                for layer, va in sa[kind].items():
                    xa, xb = sorted(v for v in va[t] if v >= 0), sorted(v for v in sb[kind][layer][t] if v >= 0)
                    if xa != xb:
                        flips.append(f"{kind}@{layer}")
            rows.append(dict(step=sa["step"], token=t, cos=float(cos[t]), argmax_same=bool(la[t].argmax() == lb[t].argmax()),
                             flips=flips))
    return rows


def main() -> None:
    a, b = (json.load(open(p)) for p in sys.argv[1:3])
    rows = compare(a, b)
    flipped = [r for r in rows if r["flips"]]
    clean = [r for r in rows if not r["flips"]]
    for r in rows:
        if r["flips"] or r["cos"] < 0.999:
            print(f"{r['step']:8s} token {r['token']:3d} cos {r['cos']:.5f} argmax_same {r['argmax_same']} flips {r['flips']}")
    worst_clean = min((r["cos"] for r in clean), default=1.0)
    worst_flip = min((r["cos"] for r in flipped), default=1.0)
    print(f"{len(rows)} tokens; {len(flipped)} with a discrete choice that differs (worst cos {worst_flip:.5f}); "
          f"the other {len(clean)}: worst cos {worst_clean:.5f}")


if __name__ == "__main__":
    main()
