"""What a cache layer hands vkv's attention implementations: a record attached to the key tensor.

The one module :mod:`hf_vkv.cache` and :mod:`hf_vkv.attention` share (neither imports the other):
the attentions' names and the records. A cache layer's ``update`` may return its key states tagged
(:func:`tag_key`) with one record under the attribute :data:`KV_TAG`; the attention reads it back
with :func:`record_of`. Two kinds:

* :class:`PagedKV` (the paged layout of the fused kernel, read by ``"vkv_paged"``): where the
  cached tokens are. The layout tags the value it returns with the same record, so the attention
  can tell a key or a value the model replaced between the update and the call (DiffLlama splits
  its values);
* :class:`SharedPrefix` (contiguous layouts under ``"vkv_cascade"``): which rows hold a prefix of
  tokens on the same pages. Rows that ``generate`` expanded from one prompt, beams with a common
  history and forks hold their first tokens on the same physical pages; the cache derives that from
  its page tables once per step, and :mod:`hf_vkv.attention.cascade` reads the prefix once for all
  of a cluster's queries.

A tag travels with the tensor the model hands its attention function, so it works however the
cache reached the model (built by ``generate``, passed as ``past_key_values``, or in a direct
``forward`` call), and untagged key/value (any other cache) are plain tensors.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

import torch

__all__ = ["CASCADE_ATTENTION", "Cluster", "KV_TAG", "PAGED_ATTENTION", "PagedKV", "Receipt", "SharedPrefix",
           "paged_kv_of", "record_of", "tag_key"]

#: The attention implementation that reads the paged layout (registered on ``import hf_vkv``).
PAGED_ATTENTION = "vkv_paged"
#: The attention implementation that reads shared prefixes once per decode step.
CASCADE_ATTENTION = "vkv_cascade"
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


@dataclass(slots=True)
class Receipt:
    """Whether an attention call got a :class:`PagedKV` its layer handed out: the attention sets
    ``read``, the layer checks it at its next update. A model that replaces both the key and the
    value after the update leaves no tag for the attention to refuse it by, only an unread record
    (and the attention would have read the new states alone)."""

    read: bool = False


@dataclass(frozen=True, slots=True)
class PagedKV:
    """Tokens ``[kv_offset, kv_offset + kv_len)`` of every row of one layer, in blocks: the K/V
    argument of every paged kernel (:mod:`hf_vkv.attention.paged_interface` states the rules).

    * ``key_cache``: ``[num_blocks, block_tokens, kv_heads, key_dim]`` view of the block store
      (``stride(-1) == 1``); ``value_cache`` likewise with ``value_dim``;
    * ``block_tables``: int32 ``[batch, max_blocks]``, on the caches' device;
    * ``kv_lens``: int32 ``[batch]``, row ``b`` holding ``kv_lens[b] <= kv_len`` tokens, or ``None``
      (every row ``kv_len``);
    * ``fused``: the cache's ``paged_kernel == "fused"``: on CUDA the attention may run a fused paged
      kernel, whose sums are ordered otherwise than sdpa's (else it gathers and runs sdpa, exact);
    * ``receipt``: set when an attention call got the record (:class:`Receipt`).
    """

    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    kv_offset: int
    kv_len: int
    kv_lens: torch.Tensor | None = None
    fused: bool = False
    receipt: Receipt = field(default_factory=Receipt, compare=False, repr=False)

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache, block_tables)``."""
        return self.key_cache, self.value_cache, self.block_tables

    def tag(self, key_states: torch.Tensor) -> torch.Tensor:
        """``key_states`` tagged with this record (:func:`tag_key`)."""
        return tag_key(key_states, self)


def paged_kv_of(key: torch.Tensor) -> PagedKV | None:
    """The record a paged layer attached to ``key``, or ``None`` for plain key states."""
    return record_of(key, PagedKV)


@dataclass(frozen=True, slots=True)
class Cluster:
    """Rows ``first .. first + rows - 1`` (consecutive) or ``index`` (any) whose keys/values
    ``[0, tokens)`` are the same bytes (the same pages)."""

    index: tuple[int, ...]
    tokens: int

    @property
    def consecutive(self) -> bool:
        return self.index == tuple(range(self.index[0], self.index[0] + len(self.index)))


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The clusters of rows (each of >= 2 rows) of one step of one layer group that share a
    prefix, and the rows in none (``alone``). Token positions count from the first token the
    layer returns (full attention: token 0)."""

    clusters: tuple[Cluster, ...]
    alone: tuple[int, ...]
    # [mask, its version, whether every cluster's rows have equal mask columns over its prefix]: a
    # forward passes one mask object to all its layers, so it is checked once per forward, not per
    # layer; the tensor's version counter moves on an in-place change, which is checked again
    _checked: list = field(default_factory=list, compare=False, repr=False)
    # [True] once an attention read the prefix once for its cluster (a model that rebuilds its keys
    # after the cache update, as multi-head latent attention does, hands its attention untagged keys)
    _read: list = field(default_factory=list, compare=False, repr=False)

    def mark_read(self) -> None:
        """An attention read this step's prefixes once (what :attr:`was_read` then says)."""
        if not self._read:
            self._read.append(True)

    @property
    def was_read(self) -> bool:
        """Whether any layer's attention read this step's prefixes once."""
        return bool(self._read)

    def mask_agrees(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` (bool ``[B, 1, q, kv]``) is the same over each cluster's prefix in
        each of its rows (rows of one prompt are padded alike; a caller's mask may differ)."""
        if self._checked and self._checked[0] is mask and self._checked[1] == mask._version:
            return self._checked[2]
        verdict = all(
            torch.equal(mask[list(c.index), ..., :c.tokens], mask[c.index[0]:c.index[0] + 1, ..., :c.tokens]
                        .expand(len(c.index), *mask.shape[1:-1], c.tokens))
            for c in self.clusters)
        self._checked[:] = [mask, mask._version, verdict]
        return verdict
