"""``deterministic_kernels``: on for CUDA within the block (deterministic algorithms, cuDNN attention
off) and restored after; a no-op elsewhere."""

from __future__ import annotations

import pytest
import torch

from hf_vkv.ab.deterministic import deterministic_kernels


@pytest.mark.parametrize("cudnn_sdp", [True, False])
@pytest.mark.parametrize("before", [(False, False), (True, False), (True, True)])
def test_cuda_turns_deterministic_kernels_on_and_restores_the_setting(before, cudnn_sdp, monkeypatch) -> None:
    """warn_only alone leaves cuDNN attention selectable, and it did not repeat itself on an H200
    (benchmarks/results/gpu_ab_kernels_h200.txt): the block turns it off too."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cuda.cudnn_sdp_enabled())
    torch.use_deterministic_algorithms(before[0], warn_only=before[1])
    torch.backends.cuda.enable_cudnn_sdp(cudnn_sdp)
    try:
        with deterministic_kernels("cuda") as on:
            assert on is True
            assert torch.are_deterministic_algorithms_enabled()
            assert torch.is_deterministic_algorithms_warn_only_enabled()
            assert not torch.backends.cuda.cudnn_sdp_enabled()
            import os

            assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        after = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
        assert after == before
        assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn_sdp
    finally:
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cuda.enable_cudnn_sdp(saved[2])


def test_restored_when_the_block_raises() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="inside"), deterministic_kernels(torch.device("cuda", 0)):
        raise RuntimeError("inside")
    assert not torch.are_deterministic_algorithms_enabled()
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_other_devices_are_left_alone() -> None:
    assert not torch.are_deterministic_algorithms_enabled()
    with deterministic_kernels("cpu") as on:
        assert on is False
        assert not torch.are_deterministic_algorithms_enabled()
