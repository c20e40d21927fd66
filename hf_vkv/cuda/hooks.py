"""What the CUDA backend needs from torch, gathered in one injectable record.

The backend calls the driver through :class:`~hf_vkv.cuda.driver.Driver` and everything else
(waiting for kernels, the current stream, making the device current, wrapping an address as a
tensor) through :class:`TorchHooks`, so the CPU tests can run the backend's logic with a recording
fake driver and hooks that record instead of touching a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch

from .dlpack import tensor_over

__all__ = ["TorchHooks", "torch_hooks"]


@dataclass(frozen=True, slots=True)
class TorchHooks:
    """The torch side of the CUDA backend for one device."""

    synchronize: Callable[[], None]  # wait for every kernel queued on the device (before an unmap)
    stream: Callable[[], int]  # the current CUDA stream as an int handle (copies are queued on it)
    guard: Callable[[], AbstractContextManager[object]]  # makes the device current for driver calls
    tensor: Callable[[int, int, object], torch.Tensor]  # (address, nbytes, owner) -> uint8 [nbytes], zero-copy
    total_bytes: Callable[[], int]  # the device's memory (bounds the physical pages the backend may hold)


def torch_hooks(device: torch.device) -> TorchHooks:
    """The real hooks for ``device`` (``cuda:N``). Initializes torch's CUDA state and the device's
    primary context on this thread, so driver calls made afterwards find a current context."""
    if device.type != "cuda" or device.index is None:
        raise ValueError(f"device must be an indexed CUDA device such as cuda:0, got {device}")
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # creates the primary context if torch had not yet
    return TorchHooks(
        synchronize=lambda: torch.cuda.synchronize(device),
        stream=lambda: int(torch.cuda.current_stream(device).cuda_stream),
        guard=lambda: torch.cuda.device(device),
        tensor=lambda address, nbytes, owner: tensor_over(address, nbytes, owner, device=device),
        total_bytes=lambda: int(torch.cuda.get_device_properties(device).total_memory),
    )
