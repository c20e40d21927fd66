"""Per-layer cache objects: the transformers ``CacheLayerMixin`` contract over a layer group.

:class:`VKVLayer` behaves like ``DynamicLayer`` and :class:`VKVSlidingLayer` like
``DynamicSlidingWindowLayer`` (same sequence lengths, mask sizes and returned K/V, bit for bit),
but ``update`` writes the new tokens in place and returns views, with no concatenation. A layer
holds no state of its own: its length, rows and pages are its group's. Row operations
(reorder, select, repeat, crop, reset) are the cache's (:class:`~hf_vkv.cache.VKVCache`), which
calls each group once.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .group import LayerGroup

__all__ = ["VKVLayer", "VKVSlidingLayer"]


class VKVLayer(CacheLayerMixin):
    """One full-attention layer's view of its group.

    ``keys`` / ``values`` are ``[B, H, S, D]`` copies of what is cached (``update`` returns
    zero-copy views, which attention uses at once).
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, group: LayerGroup, layer_idx: int) -> None:
        self.group = group
        self.layer_idx = layer_idx
        super().__init__()

    # The mixin's __init__ assigns None to keys/values; here they are read from the group. As
    # copies: a caller may keep them (as DynamicLayer's), and a kept view would change under later
    # reorders and copy-on-write, and kill the process with SIGSEGV once its pages are unmapped.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.group.cached(self.layer_idx)[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.keys is read from the cache; write through update()")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.group.cached(self.layer_idx)[1] if self.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.values is read from the cache; write through update()")

    @property
    def dtype(self) -> torch.dtype | None:
        g = self.group.geometry
        return None if g is None else g.dtype

    @property
    def device(self) -> torch.device | None:
        g = self.group.geometry
        return None if g is None else g.device

    # ----------------------------------------------------------------------------- the contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Join the group with the first states (``[B, H, q, D]``); the group checks they match."""
        self.group.init_layer(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` states after the cached tokens; return ``[B, H, kv_length, D]``
        views of everything attention needs (``kv_length`` as given by :meth:`get_mask_sizes`),
        or in the paged layout the new states tagged for the ``"vkv_paged"`` attention."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        return self.group.update(self.layer_idx, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.group.length(self.layer_idx)

    def get_max_length(self) -> int:
        return -1

    def offload(self) -> None:
        """Pages stay where they are: nothing to move."""

    def prefetch(self) -> None:
        """Pages stay where they are: nothing to fetch."""


class VKVSlidingLayer(VKVLayer):
    """A sliding-window (or chunked) layer: returns the last ``window - 1`` cached tokens plus the
    new ones, like ``DynamicSlidingWindowLayer``; pages wholly behind the window go back to the pool."""

    is_sliding = True

    def __init__(self, group: LayerGroup, layer_idx: int, *, sliding_window: int) -> None:
        self.sliding_window = sliding_window
        super().__init__(group, layer_idx)

    @property
    def cumulative_length(self) -> int:
        return self.get_seq_length()

    @property
    def record_past(self) -> bool:
        return self.group.record_past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self.group.window_start(length)
        return length - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window
