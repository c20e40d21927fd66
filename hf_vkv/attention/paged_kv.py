"""What a cache layer hands vkv's attention implementations: a record attached to the key tensor.

A cache layer's ``update`` may return its key states tagged (:func:`tag_key`) with one record
under the attribute :data:`KV_TAG`; the attention reads it back with :func:`record_of`. Two kinds:

* :class:`PagedKV` (the paged layout, read by ``"vkv_paged"``): where the cached tokens are;
* :class:`~hf_vkv.attention.shared_prefix.SharedPrefix` (contiguous layouts under
  ``"vkv_cascade"``): which rows hold a prefix of tokens on the same pages.

A tag travels with the tensor the model hands its attention function, so it works however the
cache reached the model (built by ``generate``, passed as ``past_key_values``, or in a direct
``forward`` call), and untagged key/value (any other cache) are plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = ["KV_TAG", "PAGED_ATTENTION", "PagedKV", "paged_kv_of", "record_of", "tag_key"]

#: The attention implementation that reads the paged layout (registered on ``import hf_vkv``).
PAGED_ATTENTION = "vkv_paged"
#: Attribute of a key tensor that carries a cache layer's record.
KV_TAG = "_hf_vkv_record"

_R = TypeVar("_R")


def tag_key(key_states: torch.Tensor, record: object) -> torch.Tensor:
    """A new tensor object over ``key_states`` carrying ``record`` (the caller's tensor stays untagged)."""
    tagged = key_states.view_as(key_states)
    setattr(tagged, KV_TAG, record)
    return tagged


def record_of(key: torch.Tensor, kind: type[_R]) -> _R | None:
    """The ``kind`` record a cache layer attached to ``key``, or ``None``."""
    record = getattr(key, KV_TAG, None)
    return record if isinstance(record, kind) else None


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Tokens ``[kv_offset, kv_offset + kv_len)`` of every row of one layer, in blocks: the K/V
    argument of every paged kernel (:mod:`hf_vkv.attention.paged_interface` states the rules).

    * ``key_cache``: ``[num_blocks, block_tokens, kv_heads, key_dim]`` view of the block store
      (``stride(-1) == 1``); ``value_cache`` likewise with ``value_dim``;
    * ``block_tables``: int32 ``[batch, max_blocks]``, on the caches' device;
    * ``kv_lens``: int32 ``[batch]``, row ``b`` holding ``kv_lens[b] <= kv_len`` tokens, or ``None``
      (every row ``kv_len``).
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_offset: int
    kv_len: int
    kv_lens: torch.Tensor | None = None

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache, block_tables)``."""
        return self.key_cache, self.value_cache, self.block_tables

    def tag(self, key_states: torch.Tensor) -> torch.Tensor:
        """``key_states`` tagged with this record (:func:`tag_key`)."""
        return tag_key(key_states, self)


def paged_kv_of(key: torch.Tensor) -> PagedKV | None:
    """The record a paged layer attached to ``key``, or ``None`` for plain key states."""
    return record_of(key, PagedKV)
