"""Which physical-memory backend serves key/value states on a given device."""

from __future__ import annotations

import torch

from ..memory import Arena, HostBackend
from ..memory.errors import VKVError

__all__ = ["UnsupportedDeviceError", "arena_for_device"]


class UnsupportedDeviceError(VKVError, ValueError):
    """Key/value states arrived on a device no backend of this installation serves."""


def arena_for_device(device: torch.device, *, page_bytes: int | None, budget_bytes: int | None) -> Arena:
    """A new :class:`Arena` for ``device``: the host (memfd/mmap) backend for CPU states.

    ``page_bytes`` / ``budget_bytes`` come from ``cache_config`` (``None``: the backend's default
    page size, no budget beyond the reservation).
    """
    device = torch.device(device)
    if device.type != "cpu":
        raise UnsupportedDeviceError(
            f"key/value states are on {device}, but this installation of hf_vkv has only the host (CPU) "
            f"backend; the CUDA backend comes with the hf_vkv[cuda] extra"
        )
    backend = HostBackend(page_bytes=page_bytes) if page_bytes else HostBackend()
    return Arena(backend, budget_bytes=budget_bytes)
