"""Fit dispatch.decode.V3_COST rows from bench_decode_sms.py sweeps (the ``sweep`` dict of each row:
'<config>S<splits>' -> us), the model of dispatch.decode.v3_cost_us:

    time = cdiv(T * cdiv(H, BLOCK_H) * S, r * SMs) * (us a program + cdiv(nb, S) * us a key block)
           + [S > 1] * (V3_MERGE_US + V3_MERGE_US_PER_MB * MB)       (merge terms as dispatched)

For each config: non-negative least squares of (us a program, us a block) for r = 1, 2, 3 programs
resident an SM, the r of least median relative error kept.

    python benchmarks/fit_v3_cost.py benchmarks/results/decode_sms_heads.json [--configs a,b]
prints each config's (r, us a program, us a block), its median / p90 relative error, and per measured
shape the model's pick against the sweep's best.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

from dsv4_ops import dispatch
from dsv4_ops.layout import HEAD_DIM

dd = dispatch.decode


def _cdiv(a, b):
    return -(-a // b)


def points(rows, config):
    """(T, H, K, SMs, S, us) of one config over every row's sweep."""
    out = []
    for r in rows:
        for key, us in (r.get("sweep") or {}).items():
            m = re.fullmatch(r"(.+)S(\d+)", key)
            if m and m.group(1) == config:
                out.append((r["T"], r["H"], r["K"], r["SMs"], int(m.group(2)), float(us)))
    return out


def merge_us(T, H, S):
    return dd.V3_MERGE_US + dd.V3_MERGE_US_PER_MB * T * H * S * HEAD_DIM * 8 / 1e6 if S > 1 else 0.0


def fit(pts, config):
    """(r, program_us, block_us, median rel err, p90 rel err) of least median error."""
    cfg = dd.v3_config(config)
    best = None
    for r in (1, 2, 3):
        a, y = [], []
        for T, H, K, sms, S, us in pts:
            nb = _cdiv(K, cfg["BLOCK_N"])
            w = _cdiv(T * _cdiv(H, cfg["BLOCK_H"]) * S, r * sms)
            a.append([w, w * _cdiv(nb, S)])
            y.append(us - merge_us(T, H, S))
        A, Y = torch.tensor(a, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
        wts = 1.0 / torch.tensor([p[-1] for p in pts], dtype=torch.float64)  # relative error
        sol = torch.linalg.lstsq(A * wts[:, None], (Y * wts)[:, None]).solution.flatten().clamp(min=0.05)
        pred = A @ sol + torch.tensor([merge_us(p[0], p[1], p[4]) for p in pts], dtype=torch.float64)
        rel = ((pred - torch.tensor([p[-1] for p in pts], dtype=torch.float64)).abs()
               / torch.tensor([p[-1] for p in pts], dtype=torch.float64)).tolist()
        rel.sort()
        cand = (r, round(sol[0].item(), 2), round(sol[1].item(), 2), statistics.median(rel), rel[int(0.9 * (len(rel) - 1))])
        if best is None or cand[3] < best[3]:
            best = cand
    return best


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--configs", default="")
    ns = ap.parse_args()
    rows = []
    for path in ns.results:
        rows += json.load(open(path))["rows"]
    names = ns.configs.split(",") if ns.configs else sorted({re.fullmatch(r"(.+)S\d+", k).group(1)
                                                              for r in rows for k in (r.get("sweep") or {})})
    fitted = {}
    for name in names:
        pts = points(rows, name)
        if len(pts) >= 3:
            fitted[name] = fit(pts, name)
            r, p, b, med, p90 = fitted[name]
            print(f"{name}: ({r}, {p}, {b})  median err {med:.1%}  p90 {p90:.1%}  over {len(pts)} points")
    for row in rows:
        sw = row.get("sweep") or {}
        if not sw:
            continue
        best = min(sw, key=sw.get)
        model = {}
        for key in sw:
            m = re.fullmatch(r"(.+)S(\d+)", key)
            if m.group(1) in fitted:
                r, p, b, _, _ = fitted[m.group(1)]
                cfg = dd.v3_config(m.group(1))
                S = int(m.group(2))
                w = _cdiv(row["T"] * _cdiv(row["H"], cfg["BLOCK_H"]) * S, r * row["SMs"])
                model[key] = w * (p + _cdiv(_cdiv(row["K"], cfg["BLOCK_N"]), S) * b) + merge_us(row["T"], row["H"], S)
        pick = min(model, key=model.get) if model else "-"
        print(f"T={row['T']} H={row['H']} K={row['K']} SMs={row['SMs']}: best {best} {sw[best]:.1f} us; "
              f"model's pick {pick} {sw.get(pick, float('nan')):.1f} us ({sw.get(pick, float('nan')) / sw[best]:.2f}x)")


if __name__ == "__main__":
    main()
