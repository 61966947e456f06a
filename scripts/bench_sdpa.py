#!/usr/bin/env python3
"""torch SDPA dense decode on the benchmark's shapes (cuDNN and flash backends, bf16), for ratios against
`locks bench --device cuda` measured on the same GPU in the same device call.

Decode of one token per sequence with GQA: the G query heads of a KV head are G query rows against
that head's K/V ([B, H_kv, G, d] x [B, H_kv, T, d]), so K/V are read once per group, as our kernels
and FlashInfer do. Same hygiene as the C++ bench: before every timed run a 200 us wait on the GPU
(so that the host has launched the timed work before the GPU reaches it: GPU time alone, as in a
model's captured decode graph) and the L2 flushed (a 256 MiB read); CUDA events, warm-up, median.
Each backend is timed launched from Python (`cudnn_us`, `flash_us`) and as a replayed CUDA graph of
the one call (`cudnn_graph_us`, `flash_graph_us`), the two ways `locks bench` times its kernels.

  python3 scripts/bench_sdpa.py --csv sdpa.csv [--ours ours.csv]   # --ours: print the joined table
"""
import argparse
import csv
import statistics
import sys

SHAPES = [
    ("llama3.1-8b", 8, 4, 128, [32768, 131072, 262144]),
    ("glm4-9b-1m-kv4", 4, 8, 128, [131072, 262144, 1048576]),
    ("glm4-9b-1m-kv2", 2, 16, 128, [131072, 262144, 1048576]),
]


def bench(args):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        sys.exit(f"bench_sdpa.py: needs PyTorch with CUDA (as on the lent H200): {e}")

    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    print(f"torch {torch.__version__}, {props.name}, {props.multi_processor_count} SMs, cuDNN "
          f"{torch.backends.cudnn.version()}")
    flush = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    flush.fill_(1)
    backends = [("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)]
    spin_cycles = int(200e-6 * 2.0e9)  # ~200 us at the H200's ~2 GHz SM clock

    def time_us(fn):
        fn()
        torch.cuda.synchronize()
        times = []
        for r in range(args.warmup + args.runs):
            torch.cuda._sleep(spin_cycles)
            flush.sum(dtype=torch.int32)
            e0 = torch.cuda.Event(enable_timing=True)
            e1 = torch.cuda.Event(enable_timing=True)
            e0.record()
            fn()
            e1.record()
            e1.synchronize()
            if r >= args.warmup:
                times.append(e0.elapsed_time(e1) * 1000.0)
        return statistics.median(times)

    def graph_of(fn):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            fn()
            fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return g
    rows = []
    for name, hkv, g, d, contexts in SHAPES:
        for ctx in contexts:
            for b in args.batches:
                t = ctx - 7  # same token count as the C++ bench (a partial last page)
                gib = 2 * b * hkv * t * d * 2 / 2**30
                if gib > args.max_gib:
                    continue
                torch.manual_seed(ctx + b)
                q = torch.randn(b, hkv, g, d, device=dev, dtype=torch.bfloat16)
                k = torch.randn(b, hkv, t, d, device=dev, dtype=torch.bfloat16)
                v = torch.randn(b, hkv, t, d, device=dev, dtype=torch.bfloat16)
                res = {"shape": name, "n_head_kv": hkv, "group": g, "head_dim": d, "context": ctx, "batch": b,
                       "bytes": 2 * b * hkv * t * d * 2}
                # Two layouts: the group's heads as query rows ([B, Hkv, G, d]) and torch's GQA form
                # ([B, Hkv*G, 1, d] with enable_gqa=True); each backend reports its faster one.
                q_gqa = q.reshape(b, hkv * g, 1, d)
                layouts = [("rows", lambda: F.scaled_dot_product_attention(q, k, v)),
                           ("gqa", lambda: F.scaled_dot_product_attention(q_gqa, k, v, enable_gqa=True))]
                for bname, be in backends:
                    best = best_graph = float("nan")
                    for lname, fn in layouts:
                        for kind in ("", "_graph"):
                            key = f"{bname}_{lname}{kind}_us"
                            try:
                                with sdpa_kernel(be):
                                    t_med = time_us(graph_of(fn).replay if kind else fn)
                                res[key] = t_med
                                if kind and not (best_graph <= t_med):
                                    best_graph = t_med
                                if not kind and not (best <= t_med):
                                    best, res[bname + "_layout"] = t_med, lname
                            except Exception as ex:  # a backend that refuses the shape / layout / capture
                                res[key] = float("nan")
                                print(f"  {name} {ctx} b{b} {bname}/{lname}{kind}: {type(ex).__name__}: "
                                      f"{str(ex)[:100]}", file=sys.stderr)
                    res[bname + "_us"] = best
                    res[bname + "_graph_us"] = best_graph
                rows.append(res)
                c, f = res.get("cudnn_us", float("nan")), res.get("flash_us", float("nan"))
                print(f"| {name} | {ctx // 1024}K | {b} | cuDNN {c:.1f} us ({res['bytes'] / c * 1e-3:.0f} GB/s, "
                      f"{res.get('cudnn_layout', '-')}; graph {res['cudnn_graph_us']:.1f}) | flash {f:.1f} us "
                      f"({res['bytes'] / f * 1e-3:.0f} GB/s, {res.get('flash_layout', '-')}; graph "
                      f"{res['flash_graph_us']:.1f}) |", flush=True)
                del q, q_gqa, k, v
                torch.cuda.empty_cache()
    if args.csv:
        keys = ["shape", "n_head_kv", "group", "head_dim", "context", "batch", "bytes", "cudnn_us", "flash_us",
                "cudnn_layout", "flash_layout", "cudnn_rows_us", "cudnn_gqa_us", "flash_rows_us", "flash_gqa_us",
                "cudnn_graph_us", "flash_graph_us", "cudnn_rows_graph_us", "cudnn_gqa_graph_us",
                "flash_rows_graph_us", "flash_gqa_graph_us"]
        with open(args.csv, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    return rows


def load_csv(path):
    with open(path) as fh:
        return list(csv.DictReader(fh))


def join(ours_path, sdpa_rows):
    ours = {(r["shape"], int(r["context"]), int(r["batch"])): r for r in load_csv(ours_path)}
    print("\nCUDA graph replays on both sides:\n| shape | context | batch | SDPA cuDNN us | SDPA flash us | our dense us | "
          "our dense / cuDNN time | LOCKS us | LOCKS vs cuDNN | LOCKS vs our dense | dense MB | LOCKS MB | fewer bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for s in sdpa_rows:
        key = (s["shape"], int(s["context"]), int(s["batch"]))
        o = ours.get(key)
        if o is None:
            continue
        c, f = float(s["cudnn_graph_us"]), float(s["flash_graph_us"])  # replayed graphs, as ours
        dn, lk = float(o["dense_us"]), float(o["locks_us"])
        db, lb = float(o["dense_bytes"]), float(o["locks_bytes"])
        print(f"| {key[0]} | {key[1] // 1024}K | {key[2]} | {c:.1f} | {f:.1f} | {dn:.1f} | {dn / c:.2f} | {lk:.1f} | "
              f"{c / lk:.1f}x | {dn / lk:.1f}x | {db / 1e6:.0f} | {lb / 1e6:.1f} | {db / lb:.2f}x |")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--max-gib", type=float, default=100.0)
    ap.add_argument("--csv", default="")
    ap.add_argument("--ours", default="", help="CSV from `locks bench --device cuda --csv`: print the joined table")
    ap.add_argument("--join-only", default="", help="join an existing SDPA CSV with --ours (no GPU needed)")
    args = ap.parse_args()
    rows = load_csv(args.join_only) if args.join_only else bench(args)
    if args.ours:
        join(args.ours, rows)


if __name__ == "__main__":
    main()
