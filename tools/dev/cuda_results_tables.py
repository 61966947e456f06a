#!/usr/bin/env python3
"""Markdown tables for docs/results-cuda.md from the two CSVs of one device run:
`locks bench --device cuda --csv ours.csv` and `scripts/bench_sdpa.py --csv sdpa.csv`.

  python3 tools/dev/cuda_results_tables.py bench/results/cuda_h200_locks_dense.csv bench/results/cuda_h200_sdpa.csv
"""
import csv
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: cuda_results_tables.py OURS.csv SDPA.csv  (locks bench --device cuda --csv, bench_sdpa.py --csv)")
    ours_path, sdpa_path = sys.argv[1], sys.argv[2]
    ours = {(r["shape"], int(r["context"]), int(r["batch"])): r for r in csv.DictReader(open(ours_path))}
    sdpa = {(r["shape"], int(r["context"]), int(r["batch"])): r for r in csv.DictReader(open(sdpa_path))}
    read = float(next(iter(ours.values()))["read_gbs"])
    # Like against like: SDPA's replayed CUDA graphs against ours (CSVs from before the graph columns:
    # SDPA launched from Python).
    graph = "cudnn_graph_us" in next(iter(sdpa.values()))
    print(f"SDPA timed as {'replayed CUDA graphs, as ours' if graph else 'launched from Python'}\n")
    print("| shape | context | batch | SDPA cuDNN µs | SDPA flash µs | our dense µs (GB/s) | our dense / cuDNN time | "
          "LOCKS step µs | LOCKS speedup vs cuDNN | vs our dense | dense MB | LOCKS MB | fewer bytes |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    def joined():  # rows of both CSVs, in our order
        for k, o in ours.items():
            if k in sdpa:
                yield k, o, sdpa[k]

    for k, o, s in joined():
        c, f = float(s["cudnn_graph_us" if graph else "cudnn_us"]), float(s["flash_graph_us" if graph else "flash_us"])
        dn, lk = float(o["dense_us"]), float(o["locks_us"])
        db, lb = float(o["dense_bytes"]), float(o["locks_bytes"])
        print(f"| {k[0]} | {k[1] // 1024}K | {k[2]} | {c:.1f} | {f:.1f} | {dn:.1f} ({db / dn * 1e-3:.0f}) | "
              f"{dn / c:.2f} | {lk:.1f} | {c / lk:.1f}x | {dn / lk:.1f}x | {db / 1e6:.0f} | {lb / 1e6:.1f} | "
              f"{db / lb:.2f}x |")
    print()
    print("| shape | context | batch | score µs | score GB/s (% of read) | select µs | sparse attention µs (GB/s) | "
          "attention MB | L2 intermediates MB | build Mpage/s | build cost / step |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for k, o in ours.items():
        sc, sb = float(o["score_us"]), float(o["score_bytes"])
        print(f"| {k[0]} | {k[1] // 1024}K | {k[2]} | {sc:.1f} | {sb / sc * 1e-3:.0f} ({100 * sb / sc * 1e-3 / read:.0f}%) "
              f"| {float(o['select_us']):.1f} | {float(o['attn_us']):.1f} ({float(o['attn_bytes']) / float(o['attn_us']) * 1e-3:.0f}) "
              f"| {float(o['attn_bytes']) / 1e6:.1f} | "
              f"{float(o['l2_intermediate_bytes']) / 1e6:.1f} | {float(o['build_pages_per_s']) / 1e6:.2f} | "
              f"{float(o['build_batch_us']) / 16 / float(o['locks_us']) * 100:.0f}% |")
    print(f"\nmeasured read bandwidth {read:.0f} GB/s, copy {float(next(iter(ours.values()))['copy_gbs']):.0f} GB/s")
    if graph and "locks_stream_us" in next(iter(ours.values())):
        print("\nThe same work launched from the host (ours: the step's kernels into a stream; SDPA: from Python):\n")
        print("| shape | context | batch | SDPA cuDNN µs | our dense µs | our dense / cuDNN time | LOCKS step µs | "
              "LOCKS speedup vs cuDNN | ours, stream / graph: dense, LOCKS | cuDNN, Python / graph |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for k, o, s in joined():
            c, cg = float(s["cudnn_us"]), float(s["cudnn_graph_us"])
            dn, lk = float(o["dense_stream_us"]), float(o["locks_stream_us"])
            print(f"| {k[0]} | {k[1] // 1024}K | {k[2]} | {c:.1f} | {dn:.1f} | {dn / c:.2f} | {lk:.1f} | {c / lk:.1f}x | "
                  f"{dn / float(o['dense_us']):.3f}, {lk / float(o['locks_us']):.3f} | {c / cg:.3f} |")


if __name__ == "__main__":
    main()
