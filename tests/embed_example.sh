#!/usr/bin/env bash
# ctest Embed.FindPackageConsumer: install this build into a scratch prefix, build examples/embed
# against it with find_package(locks) (as an engine would), and run it.
#   tests/embed_example.sh BUILD_DIR SOURCE_DIR CXX_COMPILER [CUDA_TOOLKIT_ROOT]
set -euo pipefail
build=$1 src=$2 cxx=$3 cuda_root=${4:-}
work=$build/embed-test
rm -rf "$work"
cmake --install "$build" --prefix "$work/prefix" > "$work.install.log" 2>&1 || { cat "$work.install.log"; exit 1; }
args=(-DCMAKE_PREFIX_PATH="$work/prefix" -DCMAKE_CXX_COMPILER="$cxx" -DCMAKE_BUILD_TYPE=Release)
[ -n "$cuda_root" ] && args+=(-DCUDAToolkit_ROOT="$cuda_root")
cmake -S "$src/examples/embed" -B "$work/build" "${args[@]}" > "$work.configure.log" 2>&1 ||
  { cat "$work.configure.log"; exit 1; }
cmake --build "$work/build" -j2 > "$work.build.log" 2>&1 || { cat "$work.build.log"; exit 1; }
"$work/build/embed_locks"
