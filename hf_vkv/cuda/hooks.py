"""What the CUDA backend needs from torch, gathered in one injectable record.

The backend calls the driver through :class:`~hf_vkv.cuda.driver.Driver` (which also makes the
device's primary context current) and everything else (waiting for kernels, the current stream,
the device's memory, wrapping an address as a tensor) through :class:`TorchHooks`, so the CPU
tests can run the backend's logic with a strict fake driver and hooks that record instead of
touching a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from .dlpack import tensor_over
from ..memory.errors import ArgumentError

__all__ = ["TorchHooks", "torch_hooks"]


@dataclass(frozen=True, slots=True)
class TorchHooks:
    """The torch side of the CUDA backend for one device."""

    synchronize: Callable[[], None]  # wait for every kernel queued on the device
    stream: Callable[[], int]  # torch's current CUDA stream as an int handle (0: the legacy default stream)
    stream_idle: Callable[[], bool]  # has every kernel queued so far on that stream finished? (never blocks)
    tensor: Callable[[int, int, object], torch.Tensor]  # (address, nbytes, owner) -> uint8 [nbytes], zero-copy
    total_bytes: Callable[[], int]  # the device's memory (bounds the physical pages the backend may hold)
    free_bytes: Callable[[], int]  # the device's free memory now, as the driver counts it


def _stream_idle(device: torch.device) -> bool:
    # An event recorded now completes once everything queued before it on the stream has; a
    # query never blocks. A fresh event each time: one event shared by threads could be
    # re-recorded by another thread between this thread's record and query.
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return bool(event.query())


def torch_hooks(device: torch.device) -> TorchHooks:
    """The real hooks for ``device`` (``cuda:N``). Initializes torch's CUDA state first, so that
    torch and the driver calls share the device's primary context."""
    if device.type != "cuda" or device.index is None:
        raise ArgumentError(f"device must be an indexed CUDA device such as cuda:0, got {device}")
    torch.cuda.init()
    with torch.cuda.device(device):
        torch.cuda.synchronize(device)  # creates the primary context if torch had not yet
    return TorchHooks(
        synchronize=lambda: torch.cuda.synchronize(device),
        stream=lambda: int(torch.cuda.current_stream(device).cuda_stream),
        stream_idle=lambda: _stream_idle(device),
        tensor=lambda address, nbytes, owner: tensor_over(address, nbytes, owner, device=device),
        total_bytes=lambda: int(torch.cuda.get_device_properties(device).total_memory),
        free_bytes=lambda: int(torch.cuda.mem_get_info(device)[0]),
    )
