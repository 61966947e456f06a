#!/usr/bin/env python3
"""Headline table of a `locks eval` results.csv: retrieval accuracy summed over the needle families,
and the fidelity chain at the answer steps (row means over contexts x families, as summary.md).
  python3 tools/dev/eval_headline.py DIR/results.csv"""
import csv
import math
import sys
from collections import defaultdict

rows = [r for r in csv.DictReader(open(sys.argv[1])) if r["family"] != "continuation"]
sels = list(dict.fromkeys(r["selector"] for r in rows))
budgets = sorted({int(r["budget"]) for r in rows if r["budget"] != "0"})
acc = defaultdict(lambda: [0, 0])
fid = defaultdict(lambda: defaultdict(list))
for r in rows:
    bs = budgets if r["budget"] == "0" else [int(r["budget"])]
    for b in bs:
        a = acc[(r["selector"], b)]
        a[0] += int(r["correct"])
        a[1] += 1
    for k in ("carrier_retention", "coverage", "oracle_coverage", "worst_head_coverage", "lse_mae", "spearman",
              "read_ratio", "output_rel_err", "carrier_obs", "carrier_retention_any"):
        v = r[k]
        if v not in ("", "nan"):
            fid[(r["selector"], int(r["budget"]))][k].append(float(v))


def mean(sel, b, k):
    v = fid[(sel, b)][k]
    return sum(v) / len(v) if v else math.nan


def weighted_carrier(sel, b):  # pooled over contexts: sum(kept) / sum(obs)
    kept = obs = 0.0
    for r in rows:
        if r["selector"] == sel and int(r["budget"]) == b and r["carrier_obs"] not in ("", "nan"):
            o = float(r["carrier_obs"])
            kept += float(r["carrier_retention"]) * o if o > 0 else 0.0
            obs += o
    return kept / obs if obs else math.nan


def f(x, p=3):
    return "–" if x != x else f"{x:.{p}f}"


lo, hi, mid = budgets[0], budgets[-1], budgets[len(budgets) // 2]
print("| selector | " + " | ".join(f"acc. b={b}" for b in budgets) +
      f" | carrier kept b={lo} / {hi} | coverage b={lo} (oracle) | worst-head cov. b={lo} | LSE MAE | Spearman | read b={mid} |")
print("|---" * (len(budgets) + 7) + "|")
for s in sels:
    cells = [f"{acc[(s, b)][0]}/{acc[(s, b)][1]}" for b in budgets]
    b0 = 0 if fid[(s, 0)] else lo
    cov = f"{f(mean(s, lo, 'coverage'))} ({f(mean(s, lo, 'oracle_coverage'))})" if fid[(s, lo)]["coverage"] else "–"
    read = mean(s, 0 if s == "full" else mid, "read_ratio")
    print(f"| {s} | " + " | ".join(cells) +
          f" | {f(weighted_carrier(s, lo))} / {f(weighted_carrier(s, hi))} | {cov} | {f(mean(s, lo, 'worst_head_coverage'))}"
          f" | {f(mean(s, lo, 'lse_mae'))} | {f(mean(s, lo, 'spearman'))} | {f(read)} |")
