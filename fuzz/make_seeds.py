#!/usr/bin/env python3
"""Writes the fuzz_gguf seed corpus (fuzz/corpus/, every file < 100 KB) from the reference models.

Seeds: the first 64 KB of each real model (truncated: exercises the error paths deep inside the
header), valid shrunken copies of both (real metadata and vocabulary, a few real tensors), byte-level
BPE vocabularies cut from the tiny Llama-3 and Qwen2 models in families/ (metadata only), a
synthetic file with every metadata type, nested arrays, every tensor type and 64-byte alignment, and
one with a block of each K-quant (Q2_K..Q6_K, patterned bytes, f16 scales 1.0).
Usage: fuzz/make_seeds.py [shared_models_dir] [out_dir]
"""
import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = sys.argv[1] if len(sys.argv) > 1 else os.path.join(HERE, "..", "..", "shared", "models")
OUT = sys.argv[2] if len(sys.argv) > 2 else os.path.join(HERE, "corpus")
SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "B", 10: "Q", 11: "q", 12: "d"}
BLOCK = {0: (1, 4), 1: (1, 2), 30: (1, 2), 8: (32, 34), 2: (32, 18), 10: (256, 84), 11: (256, 110), 12: (256, 144),
         13: (256, 176), 14: (256, 210)}


def parse(b):
    """Minimal GGUF reader: ([(key, type, raw value bytes)], [(name, ne, type, offset)], data)."""
    p = 4 + 4
    n_t, n_kv = struct.unpack_from("<QQ", b, p)
    p += 16

    def skip_value(t, p):
        if t == 8:
            return p + 8 + struct.unpack_from("<Q", b, p)[0]
        if t == 9:
            et, n = struct.unpack_from("<IQ", b, p)
            p += 12
            for _ in range(n):
                p = skip_value(et, p)
            return p
        return p + struct.calcsize("<" + SCALAR[t])

    kvs = []
    for _ in range(n_kv):
        (kl,) = struct.unpack_from("<Q", b, p)
        key = b[p + 8:p + 8 + kl]
        p += 8 + kl
        (t,) = struct.unpack_from("<I", b, p)
        p += 4
        end = skip_value(t, p)
        kvs.append((key, t, b[p:end]))
        p = end
    tensors = []
    for _ in range(n_t):
        (nl,) = struct.unpack_from("<Q", b, p)
        name = b[p + 8:p + 8 + nl]
        p += 8 + nl
        (nd,) = struct.unpack_from("<I", b, p)
        ne = list(struct.unpack_from("<%dQ" % nd, b, p + 4))
        p += 4 + 8 * nd
        t, off = struct.unpack_from("<IQ", b, p)
        p += 12
        tensors.append((name, ne, t, off))
    data = (p + 31) // 32 * 32
    return kvs, tensors, b[data:]


def nbytes(ne, t):
    n = 1
    for d in ne:
        n *= d
    be, bb = BLOCK[t]
    return n // be * bb


def write(kvs, tensors, align=32, version=3):
    """tensors: [(name, ne, type, data bytes)]; offsets are assigned here."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", version, len(tensors), len(kvs)))
    for key, t, raw in kvs:
        out += struct.pack("<Q", len(key)) + key + struct.pack("<I", t) + raw
    off = 0
    blobs = []
    for name, ne, t, data in tensors:
        out += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(ne))
        out += struct.pack("<%dQ" % len(ne), *ne) + struct.pack("<IQ", t, off)
        blobs.append((off, data))
        off = (off + len(data) + align - 1) // align * align
    out += b"\0" * (-len(out) % align)
    start = len(out)
    for o, data in blobs:
        out += b"\0" * (start + o - len(out)) + data
    return bytes(out)


def gstr(s):
    return struct.pack("<Q", len(s)) + s


def shrink_tokens(kvs, keep):
    """Cut the three tokenizer arrays to their first `keep` entries."""
    res = []
    for key, t, raw in kvs:
        if key in (b"tokenizer.ggml.tokens", b"tokenizer.ggml.scores", b"tokenizer.ggml.token_type"):
            et, n = struct.unpack_from("<IQ", raw, 0)
            body = raw[12:]
            if et == 8:
                p = 0
                for _ in range(keep):
                    p += 8 + struct.unpack_from("<Q", body, p)[0]
                body = body[:p]
            else:
                body = body[:keep * 4]
            raw = struct.pack("<IQ", et, keep) + body
        res.append((key, t, raw))
    return res


def read_strs(raw):
    et, n = struct.unpack_from("<IQ", raw, 0)
    p, out = 12, []
    for _ in range(n):
        (l,) = struct.unpack_from("<Q", raw, p)
        out.append(raw[p + 8:p + 8 + l])
        p += 8 + l
    return out


def bpe_seed(path, keep):
    """A gpt2 vocabulary: the first `keep` tokens and the control tokens, the merges inside them."""
    kvs, _, _ = parse(open(path, "rb").read())
    d = {k: (t, raw) for k, t, raw in kvs}
    toks = read_strs(d[b"tokenizer.ggml.tokens"][1])
    types = list(struct.unpack_from("<%di" % len(toks), d[b"tokenizer.ggml.token_type"][1], 12))
    ids = [i for i in range(len(toks)) if i < keep or types[i] != 1]
    new = {toks[i]: j for j, i in enumerate(ids)}
    merges = [m for m in read_strs(d[b"tokenizer.ggml.merges"][1])
              if m.find(b" ", 1) > 0 and all(x in new for x in (m[:m.find(b" ", 1)], m[m.find(b" ", 1) + 1:],
                                                                  m.replace(b" ", b"", 1)))]
    res = []
    for key, t, raw in kvs:
        if key == b"tokenizer.ggml.tokens":
            raw = struct.pack("<IQ", 8, len(ids)) + b"".join(gstr(toks[i]) for i in ids)
        elif key == b"tokenizer.ggml.token_type":
            raw = struct.pack("<IQ", 5, len(ids)) + b"".join(struct.pack("<i", types[i]) for i in ids)
        elif key == b"tokenizer.ggml.merges":
            raw = struct.pack("<IQ", 8, len(merges)) + b"".join(gstr(m) for m in merges)
        elif key in (b"tokenizer.ggml.bos_token_id", b"tokenizer.ggml.eos_token_id"):
            raw = struct.pack("<I", new[toks[struct.unpack("<I", raw)[0]]])
        elif not key.startswith(b"tokenizer.") and key != b"general.architecture":
            continue
        res.append((key, t, raw))
    return write(res, [])


def main():
    os.makedirs(OUT, exist_ok=True)
    seeds = {}
    for fname, short in (("stories260K-f32.gguf", "stories"), ("locks-ref-a-q8_0.gguf", "locksref")):
        b = open(os.path.join(MODELS, fname), "rb").read()
        seeds[short + "-head64k.gguf"] = b[:64 * 1024]
        kvs, tensors, data = parse(b)
        if short == "locksref":
            kvs = shrink_tokens(kvs, 400)  # the full 4096-entry vocabulary alone is 85 KB
        kept, budget = [], 48 * 1024
        for name, ne, t, off in tensors:
            size = nbytes(ne, t)
            if name.endswith(b"attn_k.weight") and len(ne) == 2:
                ne, size = [ne[0], 2], nbytes([ne[0], 2], t)  # two rows of a real quantized matrix
            if size <= budget and len(kept) < 8:
                kept.append((name, ne, t, data[off:off + size]))
                budget -= size
        seeds[short + "-small.gguf"] = write(kvs, kept)

    families = os.path.join(MODELS, "families")
    seeds["llama3-bpe-vocab.gguf"] = bpe_seed(os.path.join(families, "tiny-llama3-Q4_K_M.gguf"), 600)
    seeds["qwen2-bpe-vocab.gguf"] = bpe_seed(os.path.join(families, "tiny-qwen2-Q5_K_M.gguf"), 600)

    # Synthetic: every value type, nested arrays, every tensor type, alignment 64, version 2.
    kvs = [
        (b"u8", 0, struct.pack("<B", 200)), (b"i8", 1, struct.pack("<b", -2)),
        (b"u16", 2, struct.pack("<H", 60000)), (b"i16", 3, struct.pack("<h", -3)),
        (b"u32", 4, struct.pack("<I", 7)), (b"i32", 5, struct.pack("<i", -7)),
        (b"f32", 6, struct.pack("<f", 0.25)), (b"bool", 7, b"\1"),
        (b"str", 8, gstr(b"llama")), (b"u64", 10, struct.pack("<Q", 1 << 40)),
        (b"i64", 11, struct.pack("<q", -5)), (b"f64", 12, struct.pack("<d", 1e300)),
        (b"general.alignment", 4, struct.pack("<I", 64)),
        (b"arr", 9, struct.pack("<IQ", 8, 2) + gstr(b"a") + gstr(b"\xe2\x96\x81b")),
        (b"nested", 9, struct.pack("<IQ", 9, 2) + struct.pack("<IQii", 5, 2, 1, 2) + struct.pack("<IQi", 5, 1, 3)),
    ]
    q8 = struct.pack("<H", 0x3800) + bytes(range(32))
    q4 = struct.pack("<H", 0xC000) + bytes(range(0, 256, 16))
    tensors = [
        (b"f32", [4, 2], 0, struct.pack("<8f", *range(8))),
        (b"f16", [4], 1, struct.pack("<4H", 0x3C00, 0x0001, 0x7C00, 0xFC01)),
        (b"bf16", [3], 30, struct.pack("<3H", 0x3F80, 0xC040, 0x7FC0)),
        (b"q8", [32, 2], 8, q8 + q8),
        (b"q4", [32], 2, q4),
    ]
    seeds["synthetic-all-types.gguf"] = write(kvs, tensors, align=64, version=2)

    # K-quants: one 256-element block each; every byte patterned, the f16 super-block scales 1.0.
    kq = []
    for t, (_, bb) in sorted(BLOCK.items()):
        if t < 10 or t > 14:
            continue
        blk = bytearray((i * 37 + t) & 0xFF for i in range(bb))
        for at in {10: (80, 82), 11: (108,), 12: (0, 2), 13: (0, 2), 14: (208,)}[t]:
            blk[at:at + 2] = struct.pack("<H", 0x3C00)
        kq.append((b"q%d_k" % (t - 8), [256], t, bytes(blk)))
    seeds["synthetic-kquants.gguf"] = write([(b"general.architecture", 8, gstr(b"qwen3"))], kq)

    for name, blob in seeds.items():
        assert len(blob) < 100 * 1024, (name, len(blob))
        with open(os.path.join(OUT, name), "wb") as f:
            f.write(blob)
        print("%-28s %6d bytes" % (name, len(blob)))


if __name__ == "__main__":
    main()
