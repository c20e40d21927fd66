"""``torch.export`` and pytrees: a VKVCache cannot be flattened into tensors, and says so.

A VKVCache's K/V live in pages mapped into virtual memory and shared between rows; a pytree of
plain tensors (what ``torch.export`` traces through) cannot express that. ``VKVCache`` is
registered as a pytree node whose flattening raises :class:`VKVExportError`, so an export fails
with an error that names vkv and what to use instead, not with a pytree error about its options.
"""

from __future__ import annotations

from typing import Any

import torch.utils._pytree as pytree

from ..memory.errors import VKVError
from .cache import VKVCache

__all__ = ["VKVExportError", "register_pytree"]


class VKVExportError(VKVError, TypeError):
    """A VKVCache was handed to ``torch.export`` (or another pytree flattener)."""


def _refuse(cache: Any) -> Any:
    raise VKVExportError(
        "hf_vkv: a VKVCache cannot be exported with torch.export or flattened into a pytree: its keys and values "
        "live in virtual-memory pages shared between rows. Export with transformers' DynamicCache or StaticCache, "
        "and use cache_implementation='vkv' for eager or compiled generate()"
    )


def register_pytree() -> None:
    """Register :class:`VKVCache` as a pytree node that refuses to flatten (idempotent)."""
    if VKVCache not in pytree.SUPPORTED_NODES:
        pytree.register_pytree_node(VKVCache, _refuse, _refuse, serialized_type_name="hf_vkv.VKVCache",
                                    flatten_with_keys_fn=_refuse)
