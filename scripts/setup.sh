#!/usr/bin/env bash
# Fresh Debian 12: install the build dependencies, build Release, run `locks run` on its defaults.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -qq
$SUDO apt-get install -y -qq --no-install-recommends \
  build-essential cmake libeigen3-dev libfmt-dev nlohmann-json3-dev libcli11-dev \
  libgtest-dev libgmock-dev libbenchmark-dev liblzma-dev xz-utils >/dev/null
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release ${LOCKS_CMAKE_ARGS:-}
cmake --build build -j"$(nproc)"
./build/bin/locks run
