#!/usr/bin/env python3
"""The TPOT table of docs/results-gpu-engine.md from the two CSVs of one device run:
`locks bench --device cuda --e2e --csv e2e.csv` and `scripts/bench_torch_decoder.py --csv torch.csv`.

  python3 tools/dev/e2e_table.py bench/results/cuda_h200_e2e.csv bench/results/cuda_h200_torch_decoder.csv
"""
import csv
import sys

NAMES = {"llama3.1-8b": "Llama-3.1-8B", "glm4-9b-1m-kv4": "GLM-4-9B-1M kv4", "glm4-9b-1m-kv2": "GLM-4-9B-1M kv2"}


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: e2e_table.py E2E.csv TORCH.csv")
    torch = {(r["shape"], int(r["context"]), int(r["batch"])): float(r["torch_tpot_ms"])
             for r in csv.DictReader(open(sys.argv[2]))}
    print("| shape | context | batch | TPOT PyTorch ms | TPOT dense ms | TPOT LOCKS ms | LOCKS vs dense | LOCKS vs "
          "PyTorch | dense / PyTorch | dense / roofline | LOCKS: GEMM | score + select | attention | summaries / step "
          "| other | TTFT s |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in csv.DictReader(open(sys.argv[1])):
        k = (r["shape"], int(r["context"]), int(r["batch"]))
        d, lk, roof = float(r["tpot_dense_ms"]), float(r["tpot_locks_ms"]), float(r["roofline_dense_ms"])
        t = torch.get(k)
        ts = f"{t:.2f}" if t else "-"
        vs_t = f"{t / lk:.2f}x" if t else "-"
        d_t = f"{d / t:.2f}" if t else "-"
        ttft = r["ttft_s"]
        ttft = "" if ttft in ("nan", "") else f"{float(ttft):.2f}"
        ctx = f"{k[1] // 1048576}M" if k[1] >= 1048576 else f"{k[1] // 1024}K"
        print(f"| {NAMES.get(k[0], k[0])} | {ctx} | {k[2]} | {ts} | {d:.2f} | {lk:.2f} | **{d / lk:.2f}x** | {vs_t} | "
              f"{d_t} | {d / roof:.2f} | {float(r['gemm_ms']):.2f} | {float(r['score_select_ms']):.2f} | "
              f"{float(r['attention_ms']):.2f} | {float(r['summary_ms_per_step']):.2f} | {float(r['other_ms']):.2f} | "
              f"{ttft} |")


if __name__ == "__main__":
    main()
