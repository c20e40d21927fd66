"""What the paged layout hands the ``"vkv_paged"`` attention: one record, attached to a tensor.

The paged cache layer's ``update`` returns the new key states with a :class:`PagedKV` under the
attribute :data:`PAGED_TAG`; the attention reads the cached tokens through it. A tag travels with
the tensor the model hands its attention function, so it works however the cache reached the
model (built by ``generate``, passed as ``past_key_values``, or in a direct ``forward`` call), and
untagged key/value (any other cache) are plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["PAGED_ATTENTION", "PAGED_TAG", "PagedKV", "paged_kv_of"]

#: The attention implementation that reads the paged layout (registered on ``import hf_vkv``).
PAGED_ATTENTION = "vkv_paged"
#: Attribute of the key tensor a paged layer's ``update`` returns.
PAGED_TAG = "_hf_vkv_paged"


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Tokens ``[kv_offset, kv_offset + kv_len)`` of every row of one layer, in blocks.

    * ``key_cache``: ``[num_blocks, block_tokens, kv_heads, key_dim]`` view of the block store
      (``stride(-1) == 1``); ``value_cache`` likewise with ``value_dim``;
    * ``block_tables``: int32 ``[batch, max_blocks]``, on the caches' device.
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_offset: int
    kv_len: int

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache, block_tables)``."""
        return self.key_cache, self.value_cache, self.block_tables

    def tag(self, key_states: torch.Tensor) -> torch.Tensor:
        """A new tensor object over ``key_states`` carrying this record (the model's own tensor
        stays untagged)."""
        tagged = key_states.view_as(key_states)
        setattr(tagged, PAGED_TAG, self)
        return tagged


def paged_kv_of(key: torch.Tensor) -> PagedKV | None:
    """The record a paged layer attached to ``key``, or ``None`` for plain key states."""
    return getattr(key, PAGED_TAG, None)
