"""Options of a :class:`~hf_vkv.cache.VKVCache`, as given in ``cache_config={...}``."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

__all__ = ["CacheOptions"]

GroupPolicy = Literal["model", "layer", "head"]
Layout = Literal["contiguous", "paged"]


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOptions:
    """What a user can set through ``generate(..., cache_config={...})`` or ``VKVCache(...)``.

    * ``page_bytes``: physical page size (host default 256 KiB; a multiple of 4 KiB). Sharing and
      copy-on-write work at this granularity.
    * ``budget_bytes``: most physical KV bytes the cache may hold per device (default: unbounded;
      the reservation's size bounds it). Going over raises ``KVCacheOutOfMemory``.
    * ``group_policy``: ``"model"`` puts all layers of one kind (full / sliding) in one token-major
      buffer (at most one partly filled page per row per group); ``"layer"`` gives every layer
      its own buffer (vAttention's layout); ``"head"`` groups layers as ``"model"`` does but stores
      each (layer, K/V, head) of a row contiguously, as a ``DynamicCache`` does, with small pages
      (see :mod:`hf_vkv.cache.heads`).
    * ``share_prompts``: store the prompt once for the rows that ``generate`` expanded from it
      (beams, ``num_return_sequences``), after checking the rows really are equal.
    * ``layout``: ``"contiguous"`` (rows mapped into virtual memory, read by any attention) or
      ``"paged"`` (rows as block tables, read by the ``"vkv_paged"`` attention). Default: paged
      when the model's attention implementation is ``"vkv_paged"``, else contiguous.
    * ``block_tokens``: tokens per block in the paged layout (default
      :data:`~hf_vkv.cache.paged.DEFAULT_BLOCK_TOKENS`); sharing and copy-on-write work per block.
    * ``max_tokens``: tokens each row can hold (default: the model's ``max_position_embeddings``,
      or the generate call's ``max_length`` when larger). Only virtual address space is reserved
      for it, so a returned cache can be passed back to ``generate()`` to continue.
    """

    page_bytes: int | None = None
    budget_bytes: int | None = None
    group_policy: GroupPolicy = "model"
    share_prompts: bool = True
    max_tokens: int | None = None
    layout: Layout | None = None
    block_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.page_bytes is not None and (not isinstance(self.page_bytes, int) or self.page_bytes <= 0):
            raise ValueError(f"cache_config['page_bytes'] must be a positive int, got {self.page_bytes!r}")
        if self.budget_bytes is not None and (not isinstance(self.budget_bytes, int) or self.budget_bytes <= 0):
            raise ValueError(f"cache_config['budget_bytes'] must be a positive int, got {self.budget_bytes!r}")
        if self.group_policy not in ("model", "layer", "head"):
            raise ValueError(
                f"cache_config['group_policy'] must be 'model', 'layer' or 'head', got {self.group_policy!r}"
            )
        if not isinstance(self.share_prompts, bool):
            raise TypeError(f"cache_config['share_prompts'] must be a bool, got {self.share_prompts!r}")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens <= 0):
            raise ValueError(f"cache_config['max_tokens'] must be a positive int, got {self.max_tokens!r}")
        if self.layout not in (None, "contiguous", "paged"):
            raise ValueError(f"cache_config['layout'] must be 'contiguous' or 'paged', got {self.layout!r}")
        if self.block_tokens is not None and (not isinstance(self.block_tokens, int) or self.block_tokens <= 0):
            raise ValueError(f"cache_config['block_tokens'] must be a positive int, got {self.block_tokens!r}")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None) -> CacheOptions:
        """Parse a ``cache_config`` dict; an unknown key is an error naming the known ones."""
        config = dict(config or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(config) - known)
        if unknown:
            raise ValueError(f"unknown cache_config key(s) {unknown} for cache_implementation='vkv'; "
                             f"known keys: {sorted(known)}")
        return cls(**config)
