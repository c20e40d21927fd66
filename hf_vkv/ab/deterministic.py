"""Kernels that give the same result every run, for an A/B on a GPU.

An A/B compares two runs bit for bit, so the reference must itself be repeatable. On CPUs it is
(a fixed thread count gives the same sums). On a GPU it need not be: measured on an H100 (torch
2.11, cuDNN attention, the default choice of ``scaled_dot_product_attention`` there), two
DynamicCache runs of the same greedy ``generate()`` (batch 8, 1,024 tokens, no padding, bf16)
differed in logits from the first decode step and in a token at step 30
(``benchmarks/results/gpu_identity_probe.json``); under ``torch.use_deterministic_algorithms``
torch chooses flash attention, DynamicCache repeats itself, and vkv matched it token for token
(``probe_deterministic.json``, ``gpu_generate_quick_deterministic.json``).

``warn_only=True`` (an operation without a deterministic kernel warns rather than fails) leaves
cuDNN attention selectable, and on an H200 (torch 2.11) that is what torch chose: two DynamicCache
runs at batch 8 x 1,024 tokens differed from step 4-13 under warn_only, and were identical, with vkv
too, once cuDNN attention was also turned off (``benchmarks/results/gpu_ab_kernels_h200.txt``). So
the block turns it off as well.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

__all__ = ["CUBLAS_WORKSPACE", "deterministic_kernels"]

#: The cuBLAS workspace setting torch's deterministic mode asks for (set before CUDA starts).
CUBLAS_WORKSPACE = ":4096:8"


@contextlib.contextmanager
def deterministic_kernels(device: torch.device | str) -> Iterator[bool]:
    """Within the block, CUDA work uses deterministic kernels (``torch.use_deterministic_algorithms``
    with ``warn_only=True``: an operation without a deterministic kernel warns rather than fails)
    and no cuDNN attention; the previous settings are restored afterwards. On other devices
    nothing changes. Yields whether deterministic kernels are in force (for a report)."""
    if torch.device(device).type != "cuda":
        yield torch.are_deterministic_algorithms_enabled()
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)  # read when cuBLAS makes its handle
    enabled, warn_only = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    cudnn_sdp = torch.backends.cuda.cudnn_sdp_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_cudnn_sdp(False)  # warn_only leaves cuDNN attention selectable
    try:
        yield True
    finally:
        torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
