#!/usr/bin/env python3
"""Regenerate examples/ from ../shared/data/heldout-text.txt.xz (held-out text the model never saw).

examples/haystack.txt    ~200 KB of whole held-out documents (the engine benchmark's text)
examples/needle-8k.txt   ~8K-token needle prompt in the reference model's training format, ending
                         with the question; `locks run` with no arguments generates the answer.
"""
import lzma, os, sys

root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
src = os.path.join(root, "..", "shared", "data", "heldout-text.txt.xz")
docs = lzma.open(src).read().decode("utf-8").split("\x1e")

# Documents from the middle of the file: a mix of kernel docs, C and Python.
hay, size = [], 0
for doc in docs[300:]:
    if size > 200_000:
        break
    hay.append(doc.strip("\n"))
    size += len(doc)
os.makedirs(os.path.join(root, "examples"), exist_ok=True)
with open(os.path.join(root, "examples", "haystack.txt"), "w") as f:
    f.write("\n\n".join(hay) + "\n")

# ~8K tokens is ~20 KB of this text (about 2.5 bytes per token). Two needles at 20% and 65% depth, ask about the first.
text = "\n\n".join(hay)[:20_500]
lines = text.split("\n")
needles = [(0.20, "harbor", "4082931"), (0.65, "violet", "0571346")]
for depth, key, value in sorted(needles, reverse=True):
    i = int(len(lines) * depth)
    lines.insert(i, f"Remember: the magic number for {key} is {value}.")
key = needles[0][1]
prompt = "\n".join(lines) + f"\nQuestion: what is the magic number for {key}? Answer: the magic number for {key} is"
with open(os.path.join(root, "examples", "needle-8k.txt"), "w") as f:
    f.write(prompt)
print("wrote examples/haystack.txt and examples/needle-8k.txt", file=sys.stderr)
