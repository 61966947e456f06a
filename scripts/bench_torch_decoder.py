#!/usr/bin/env python3
"""A plain PyTorch dense decoder of the end-to-end benchmark's shapes, for TPOT ratios against
`locks bench --device cuda --e2e` measured on the same GPU in the same device call.

What a user could write in an afternoon: random bf16 weights (Q/K/V fused, gate/up fused), a static
KV cache [B, H_kv, T, d] bf16 whose last position the step writes, RMSNorm, RoPE, SDPA on the cuDNN
backend over the whole cache in torch's GQA form (q [B, H, 1, d], enable_gqa=True: cuDNN's fast decode
layout, 484 us per layer at 1M tokens where the group's heads as query rows take 13.3 ms; see
bench/results/cuda_h200_sdpa.csv), SwiGLU, logits, argmax; the whole decode step captured in one
CUDA graph and replayed. TPOT = median of the replays (CUDA events, a 300 us wait on the GPU before
each so the host has launched the step before the GPU reaches it).

  python3 scripts/bench_torch_decoder.py --csv torch.csv [--shapes glm4-9b-1m-kv4] [--contexts 262144]
"""
import argparse
import csv
import statistics
import sys

# name, layers, query heads, KV heads, head_dim, FFN, vocab, contexts (as locks' default_e2e_shapes)
SHAPES = [
    ("llama3.1-8b", 32, 32, 8, 128, 14336, 128256, [32768, 131072, 262144]),
    ("glm4-9b-1m-kv4", 40, 32, 4, 128, 13696, 151552, [32768, 262144, 1048576]),
    ("glm4-9b-1m-kv2", 40, 32, 2, 128, 13696, 151552, [262144, 1048576]),
]


def run(args):
    try:
        import torch
        import torch.nn.functional as F
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError as e:
        sys.exit(f"bench_torch_decoder.py: needs PyTorch with CUDA (as on the lent H200): {e}")
    dev = torch.device("cuda")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_properties(dev).name}, cuDNN "
          f"{torch.backends.cudnn.version()}")
    rows = []
    spin_cycles = int(300e-6 * 2.0e9)
    for name, L, NH, NKV, D, FF, V, contexts in SHAPES:
        if args.shapes and name not in args.shapes.split(","):
            continue
        E = NH * D
        g = torch.Generator(device=dev).manual_seed(0)

        def w(n_out, n_in):
            a = (3.0 / n_in) ** 0.5
            return ((torch.rand(n_out, n_in, device=dev, generator=g) * 2 - 1) * a).to(torch.bfloat16)

        layers = [dict(qkv=w((NH + 2 * NKV) * D, E), o=w(E, NH * D), gu=w(2 * FF, E), down=w(E, FF),
                       n1=torch.ones(E, device=dev, dtype=torch.bfloat16),
                       n2=torch.ones(E, device=dev, dtype=torch.bfloat16)) for _ in range(L)]
        emb = w(V, E)
        out_w = w(V, E)
        norm_f = torch.ones(E, device=dev, dtype=torch.bfloat16)
        inv_freq = 1.0 / (1e7 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float64) / D))
        ctxs = [c for c in contexts if not args.contexts or str(c) in args.contexts.split(",")]
        for T in ctxs:
            for B in [int(b) for b in args.batches.split(",")]:
                kv_bytes = 2 * L * B * NKV * T * D * 2
                free, _ = torch.cuda.mem_get_info()
                if kv_bytes + (4 << 30) > free:
                    print(f"{name} {T // 1024}K b{B}: skipped (KV {kv_bytes / 2**30:.0f} GiB > free)")
                    continue
                # Contiguous [B, H_kv, T, d] caches: a slice of a longer one is a strided view, which
                # SDPA would copy at every step.
                kc = [torch.randn(B, NKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
                vc = [torch.randn(B, NKV, T, D, device=dev, dtype=torch.bfloat16) for _ in range(L)]
                tok = torch.ones(B, dtype=torch.long, device=dev)
                pos = T - 1  # the step appends at T - 1 and attends the T positions before and at it
                ang = pos * inv_freq
                cos = torch.cos(ang).float().repeat_interleave(2)
                sin = torch.sin(ang).float().repeat_interleave(2)

                def rope(x):  # interleaved pairs (2i, 2i + 1)
                    x2 = torch.stack((-x[..., 1::2], x[..., 0::2]), dim=-1).flatten(-2)
                    return (x.float() * cos + x2.float() * sin).to(torch.bfloat16)

                def step():
                    x = emb[tok]  # [B, E]
                    for lw, k_cache, v_cache in zip(layers, kc, vc):
                        h = F.rms_norm(x, (E,), lw["n1"], 1e-5)
                        qkv = h @ lw["qkv"].t()
                        q = qkv[:, :NH * D].view(B, NH, 1, D)
                        k = qkv[:, NH * D:(NH + NKV) * D].view(B, NKV, 1, D)
                        v = qkv[:, (NH + NKV) * D:].view(B, NKV, 1, D)
                        q, k = rope(q), rope(k)
                        k_cache[:, :, pos:pos + 1] = k
                        v_cache[:, :, pos:pos + 1] = v
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            a = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
                        x = x + a.reshape(B, NH * D) @ lw["o"].t()
                        h = F.rms_norm(x, (E,), lw["n2"], 1e-5)
                        gu = h @ lw["gu"].t()
                        x = x + (F.silu(gu[:, :FF]) * gu[:, FF:]) @ lw["down"].t()
                    logits = F.rms_norm(x, (E,), norm_f, 1e-5) @ out_w.t()
                    return logits.argmax(-1)

                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                times = []
                for r in range(args.warmup + args.steps):
                    torch.cuda._sleep(spin_cycles)
                    e0 = torch.cuda.Event(enable_timing=True)
                    e1 = torch.cuda.Event(enable_timing=True)
                    e0.record()
                    graph.replay()
                    e1.record()
                    e1.synchronize()
                    if r >= args.warmup:
                        times.append(e0.elapsed_time(e1))
                ms = statistics.median(times)
                print(f"{name} {T // 1024}K b{B}: TPOT {ms:.2f} ms", flush=True)
                rows.append(dict(shape=name, context=T, batch=B, torch_tpot_ms=f"{ms:.4f}"))
                del kc, vc, graph
                torch.cuda.empty_cache()
        del layers, emb, out_w
        torch.cuda.empty_cache()
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            wr = csv.DictWriter(f, fieldnames=["shape", "context", "batch", "torch_tpot_ms"])
            wr.writeheader()
            wr.writerows(rows)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--csv", help="write the rows here")
    ap.add_argument("--shapes", default="", help="comma-separated shape names (default: all)")
    ap.add_argument("--contexts", default="", help="comma-separated contexts (default: each shape's)")
    ap.add_argument("--batches", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    run(ap.parse_args())


if __name__ == "__main__":
    main()
