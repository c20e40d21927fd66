"""Per-layer cache objects: the transformers ``CacheLayerMixin`` contract over a layer group.

:class:`VKVLayer` behaves like ``DynamicLayer`` and :class:`VKVSlidingLayer` like
``DynamicSlidingWindowLayer`` (same sequence lengths, mask sizes and returned K/V, bit for bit),
but ``update`` writes the new tokens in place and returns strided views, with no concatenation.
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
        self._group = group
        self.layer_idx = layer_idx
        self._length = 0  # tokens this layer has cached
        super().__init__()
        group.register(self)

    # The mixin's __init__ assigns None to keys/values; here they are read from the group. As
    # copies: a caller may keep them (as DynamicLayer's), and a kept view would change under later
    # reorders and copy-on-write, and kill the process with SIGSEGV once its pages are unmapped
    # (window moved on, crop, cache freed).
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._cached()[0].clone() if self.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.keys is read from the cache; write through update()")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self._cached()[1].clone() if self.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.values is read from the cache; write through update()")

    @property
    def group(self) -> LayerGroup:
        """The layer group whose buffer holds this layer's tokens."""
        return self._group

    @property
    def dtype(self) -> torch.dtype | None:
        g = self._group.geometry
        return None if g is None else g.dtype

    @property
    def device(self) -> torch.device | None:
        g = self._group.geometry
        return None if g is None else g.device

    def _cached(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._group.states(self.layer_idx, self._visible_start(self._length), self._length)

    def _visible_start(self, length: int) -> int:
        return 0

    # ----------------------------------------------------------------------------- the contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Join the group with the first states (``[B, H, q, D]``); the group checks they match."""
        self._group.init_layer(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` states after the cached tokens; return ``[B, H, kv_length, D]``
        views of everything attention needs (``kv_length`` as given by :meth:`get_mask_sizes`).

        In the paged layout the new states come back instead, tagged for the ``"vkv_paged"``
        attention, which reads the cached tokens through block tables (see ``hf_vkv.cache.paged``)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        group = self._group
        start, end = self._length, self._length + key_states.shape[2]
        group.prepare(key_states.shape[0], start, end)
        group.write(self.layer_idx, start, key_states, value_states)
        visible = self._visible_start(start)
        self._length = end
        return group.attention_inputs(self.layer_idx, visible, end, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._length + query_length, 0

    def get_seq_length(self) -> int:
        return self._length

    def get_max_length(self) -> int:
        return -1

    # ----------------------------------------------------------------------------- row operations
    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        """Row ``i`` takes row ``beam_idx[i]``'s pages (``beam_idx``: int tensor, any device)."""
        index = [int(i) for i in beam_idx.tolist()]
        self._group.collective("reorder", self.layer_idx, lambda: self._group.reorder(index))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows ``indices`` (whatever indexes a tensor's batch dimension, as in
        ``DynamicLayer``: row numbers, negative ones, a bool mask)."""
        if isinstance(indices, torch.Tensor):
            indices = indices.cpu()
        group = self._group
        group.collective("select", self.layer_idx,
                         lambda: group.reorder(torch.arange(group.batch)[indices].reshape(-1).tolist()))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (pages shared, nothing copied)."""
        self._group.collective("repeat", self.layer_idx, lambda: self._group.repeat_rows(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int, as for DynamicLayer)."""
        tokens_to_remove = int(tokens_to_remove)  # transformers 5.17's assisted decoding passes a 0-d tensor
        if tokens_to_remove > 0:
            raise ValueError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._length = max(self._length + tokens_to_remove, 0)
        self._group.truncate_to_members()

    def reset(self) -> None:
        """Forget every cached token (pages go back to the pool)."""
        self._length = 0
        self._group.collective("reset", self.layer_idx, self._group.clear)

    def offload(self) -> None:
        """Pages stay where they are: nothing to move."""

    def prefetch(self) -> None:
        """Pages stay where they are: nothing to fetch."""


class VKVSlidingLayer(VKVLayer):
    """A sliding-window layer: returns the last ``window - 1`` cached tokens plus the new ones,
    like ``DynamicSlidingWindowLayer``; pages wholly behind the window go back to the pool."""

    is_sliding = True

    def __init__(self, group: LayerGroup, layer_idx: int, *, sliding_window: int) -> None:
        self.sliding_window = sliding_window
        super().__init__(group, layer_idx)

    @property
    def cumulative_length(self) -> int:
        return self._length

    def _visible_start(self, length: int) -> int:
        return self._group.window_start(length)

    def activate_past_recording(self) -> None:
        """Keep pages behind the window until :meth:`crop` (assisted decoding rolls back)."""
        self._group.record_past = True

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        offset = self._group.window_start(self._length)
        return self._length - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window

    def crop(self, tokens_to_remove: int) -> None:
        if self._length >= self.sliding_window and not self._group.record_past:
            raise RuntimeError(
                "`crop` was called, but the current layer does not track past states, and the sliding window size "
                "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache."
            )
        super().crop(tokens_to_remove)
