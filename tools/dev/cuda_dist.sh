#!/usr/bin/env bash
# Build the CUDA-enabled binaries here (no GPU needed) and bundle them with the shared libraries a
# bare CUDA image may lack, for running on the lent H200 (tools/dev/cuda_device_run.sh there).
#   tools/dev/cuda_dist.sh [build-dir]      -> <build-dir>/dist/{bin,lib}
set -euo pipefail
cd "$(dirname "$0")/../.."
BUILD=${1:-build-cuda}
cmake -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLOCKS_WERROR=ON -DLOCKS_NATIVE=OFF -DCMAKE_CUDA_ARCHITECTURES=90a >/dev/null
cmake --build "$BUILD" -j2 --target locks locks_tests
rm -rf "$BUILD/dist" && mkdir -p "$BUILD/dist/bin" "$BUILD/dist/lib"
cp "$BUILD/bin/locks" "$BUILD/bin/locks_tests" "$BUILD/dist/bin/"
nvcc -O3 -std=c++17 -gencode=arch=compute_90a,code=sm_90a bench/cuda_read_patterns.cu -o "$BUILD/dist/bin/read_patterns"
# examples/embed built against an install of this build, as an engine would (the GPU step runs there)
bash tests/embed_example.sh "$(realpath "$BUILD")" "$PWD" "$(command -v g++)" "$(dirname "$(dirname "$(command -v nvcc)")")" >/dev/null
cp "$BUILD/embed-test/build/embed_locks" "$BUILD/dist/bin/"
strip "$BUILD"/dist/bin/*   # host symbols only (the device code stays): the carry is limited to 64 MiB
for lib in $(ldd "$BUILD/bin/locks" "$BUILD/bin/locks_tests" "$BUILD/dist/bin/embed_locks" | awk '/=>/ {print $3}' | sort -u); do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libstdc++*|libgcc_s*|ld-linux*) ;;   # the image's own (newer) ones
    *) cp -L "$lib" "$BUILD/dist/lib/" ;;
  esac
done
du -sh "$BUILD/dist"
