"""The ideal cache of the benchmark: K/V preallocated at full capacity, handed out as narrow views.

:class:`IdealCache` is the fastest way any cache can hand K/V to attention on a CPU: every layer's
keys and values are one contiguous ``[B, H, capacity, D]`` tensor each (so each (row, head) is
one contiguous ``[capacity, D]`` buffer, as in a DynamicCache), ``update`` writes the new tokens
with one narrow ``copy_`` and returns the views ``[:, :, :T]`` (no copy, no concatenation). It
pays for the whole capacity up front, which is why it exists only as the benchmark's yardstick:
a vkv layout is as fast as it can be when its decode step matches this one.

It is token-identical to DynamicCache (greedy, left-padded batches, beam search), which
``tests/integration/test_bench.py`` checks on a tiny Llama.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import Cache, CacheLayerMixin

from ..memory.errors import ArgumentError, CapacityError

__all__ = ["IdealCache", "IdealLayer"]


class IdealLayer(CacheLayerMixin):
    """One full-attention layer: ``keys`` / ``values`` are views ``[B, H, T, D]`` of the buffers
    ``[B, H, capacity, D]`` allocated at the first update."""

    is_sliding = False
    is_croppable = True
    is_compileable = False

    def __init__(self, capacity: int) -> None:
        super().__init__()
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ArgumentError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity
        self.length = 0
        self.key_buffer: torch.Tensor | None = None  # [B, H, capacity, D]
        self.value_buffer: torch.Tensor | None = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Allocate both buffers for ``key_states``' batch, heads, dtype and device."""
        b, h, _, d = key_states.shape
        self.dtype, self.device = key_states.dtype, key_states.device
        self.key_buffer = key_states.new_zeros((b, h, self.capacity, d))
        self.value_buffer = value_states.new_zeros((b, h, self.capacity, value_states.shape[-1]))
        self.is_initialized = True
        self._narrow()

    def _narrow(self) -> None:
        assert self.key_buffer is not None and self.value_buffer is not None
        self.keys = self.key_buffer[:, :, : self.length]
        self.values = self.value_buffer[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` new states after the cached ones; return views ``[B, H, T + q, D]``."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        assert self.key_buffer is not None and self.value_buffer is not None
        q = key_states.shape[-2]
        if self.length + q > self.capacity:
            raise CapacityError(f"IdealCache holds {self.capacity} tokens per row; {self.length} + {q} do not fit: make "
                                f"it with capacity >= prompt + new tokens")
        self.key_buffer[:, :, self.length : self.length + q].copy_(key_states)
        self.value_buffer[:, :, self.length : self.length + q].copy_(value_states)
        self.length += q
        self._narrow()
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return self.capacity

    def reset(self) -> None:
        self.length = 0
        if self.is_initialized:
            self._narrow()

    def crop(self, tokens_to_remove: int) -> None:
        """Forget the last ``-tokens_to_remove`` tokens (a negative int, as for DynamicLayer)."""
        tokens_to_remove = int(tokens_to_remove)
        if tokens_to_remove > 0:
            raise ArgumentError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        if self.is_initialized:
            self.length = max(self.length + tokens_to_remove, 0)
            self._narrow()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` ([B] int64) become rows ``0..B-1``, in place (the cached tokens only)."""
        if self.is_initialized and self.length:
            index = beam_idx.to(self.device)
            self.keys.copy_(self.keys.index_select(0, index))
            self.values.copy_(self.values.index_select(0, index))

    def batch_repeat_interleave(self, repeats: int) -> None:
        if self.is_initialized:
            assert self.key_buffer is not None and self.value_buffer is not None
            self.key_buffer = self.key_buffer.repeat_interleave(repeats, dim=0)
            self.value_buffer = self.value_buffer.repeat_interleave(repeats, dim=0)
            self._narrow()

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self.is_initialized:
            assert self.key_buffer is not None and self.value_buffer is not None
            self.key_buffer = self.key_buffer[indices].contiguous()
            self.value_buffer = self.value_buffer[indices].contiguous()
            self._narrow()

    def nbytes(self) -> int:
        """Bytes of both buffers (the whole capacity: that is what this cache holds)."""
        if not self.is_initialized:
            return 0
        assert self.key_buffer is not None and self.value_buffer is not None
        return self.key_buffer.nbytes + self.value_buffer.nbytes


class IdealCache(Cache):
    """A :class:`IdealLayer` per layer of a model whose layers are all full attention.

    Args:
        config: the model's config (its text/decoder part is used).
        capacity: tokens per row, prompt included (buffers are ``[B, H, capacity, D]`` per layer).
    """

    def __init__(self, config: PretrainedConfig, *, capacity: int) -> None:
        text = config.get_text_config(decoder=True)
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if set(types) != {"full_attention"}:
            raise ArgumentError(f"IdealCache serves full-attention layers only; this model has {sorted(set(types))}: "
                                f"compare the other caches without it")
        super().__init__(layers=[IdealLayer(capacity) for _ in types])

    def nbytes(self) -> int:
        """Bytes of every layer's buffers."""
        return sum(layer.nbytes() for layer in self.layers)
