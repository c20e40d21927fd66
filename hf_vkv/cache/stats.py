"""Memory accounting of a :class:`~hf_vkv.cache.VKVCache`: per group and in total."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats", "GroupStats"]


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Memory of one layer group (bytes; a page shared by several rows is counted once)."""

    name: str
    layout: str | None  # the group's layout (None before its first update)
    layers: int
    rows: int
    resident_bytes: int  # physical pages this group's rows hold
    token_bytes: int  # bytes of live tokens in them
    shared_pages: int  # pages held by more than one row (or fork)
    cow_copies: int  # pages copied on write so far
    shared_prompt_rows: int  # rows that took their prompt from another row's pages
    tail_copies: int = 0  # partly written pages beam reorders copied into a row's own page (no later CoW)

    @property
    def utilization(self) -> float:
        return self.token_bytes / self.resident_bytes if self.resident_bytes else 1.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Memory of a :class:`~hf_vkv.cache.VKVCache`: per group and in total, and how many of the
    model's layers vkv stores (the others stay in transformers' own layer classes)."""

    groups: tuple[GroupStats, ...]
    pool_resident_bytes: int  # physical bytes held by the cache's arenas (free pages kept for reuse too)
    vkv_layers: int  # layers whose KV vkv stores
    transformers_layers: int  # layers kept in transformers' own classes (linear/recurrent state, ...)
    prompt_tokens_computed: int = 0  # prompt tokens generate's prefills ran through the model (rows x tokens)
    prompt_tokens_saved: int = 0  # prompt tokens not computed: rows that took a repeated prompt's pages instead
    prefill_once: str = "no expanded prefill yet"  # "on", or why the last expanded prefill ran on every row
    cascade: str = "not asked"  # under "vkv_cascade": "on", or why shared prefixes are not tagged (half precision, or the last step's rows share too few tokens)

    @property
    def resident_bytes(self) -> int:
        return sum(g.resident_bytes for g in self.groups)

    @property
    def token_bytes(self) -> int:
        return sum(g.token_bytes for g in self.groups)

    @property
    def utilization(self) -> float:
        return self.token_bytes / self.resident_bytes if self.resident_bytes else 1.0

    @property
    def shared_pages(self) -> int:
        return sum(g.shared_pages for g in self.groups)

    @property
    def cow_copies(self) -> int:
        return sum(g.cow_copies for g in self.groups)

    @property
    def tail_copies(self) -> int:
        return sum(g.tail_copies for g in self.groups)
