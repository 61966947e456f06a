#!/usr/bin/env bash
# Build the libFuzzer GGUF target (clang, ASan + UBSan) and run it.
#   scripts/fuzz_gguf.sh [seconds=180] [extra libFuzzer flags...]
# Seeds come from fuzz/corpus (regenerate with fuzz/make_seeds.py when ../shared is present); new
# inputs go to build-fuzz/corpus so the committed seed set stays small. Crash reproducers land in
# build-fuzz/artifacts; replay one with: build-fuzz/bin/fuzz_gguf build-fuzz/artifacts/crash-...
set -euo pipefail
cd "$(dirname "$0")/.."
seconds="${1:-180}"
shift || true

CC=clang CXX=clang++ cmake -B build-fuzz -DLOCKS_FUZZ=ON -DLOCKS_BUILD_TESTS=OFF -DLOCKS_BUILD_BENCH=OFF
cmake --build build-fuzz --target fuzz_gguf -j2

if [ -z "$(ls -A fuzz/corpus 2>/dev/null)" ]; then
  python3 fuzz/make_seeds.py ../shared/models fuzz/corpus
fi
mkdir -p build-fuzz/corpus build-fuzz/artifacts
exec build-fuzz/bin/fuzz_gguf build-fuzz/corpus fuzz/corpus \
  -max_total_time="$seconds" -max_len=65536 -artifact_prefix=build-fuzz/artifacts/ \
  -print_final_stats=1 "$@"
