"""Memory accounting of a :class:`~hf_vkv.cache.VKVCache`: per group and in total."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CacheStats", "GroupStats", "PrefillCounts", "ReuseReport"]


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
    mappings: int = 0  # kernel mappings (vm.max_map_count) its reservation holds on the host (0 elsewhere)

    @property
    def utilization(self) -> float:
        return self.token_bytes / self.resident_bytes if self.resident_bytes else 1.0


@dataclass(slots=True)
class PrefillCounts:
    """What ``generate``'s prefills of repeated prompts did on one cache (prefill once,
    :mod:`hf_vkv.generate.prefill_once` writes them; :meth:`VKVCache.stats` reports them).
    Plain counters: they refer to no cache."""

    computed: int = 0  # prompt tokens the prefills ran through the model (rows x tokens)
    saved: int = 0  # prompt tokens spared by running each repeated prompt once
    verdict: str = "no expanded prefill yet"  # "on", or why the last expanded prefill ran on every row


@dataclass(slots=True)
class ReuseReport:
    """What prefix reuse did in the ``generate`` call that last used a cache with a prefix store
    (``out.cache.stats().reuse``; :mod:`hf_vkv.generate.reuse` fills it)."""

    refusal: str | None = None  # why reuse did not apply (None: it did)
    rows: int = 0  # rows of the prefill (after num_beams / num_return_sequences expansion)
    prompt_tokens: int = 0  # tokens of the prompts (padding excluded), every row
    reused_tokens: int = 0  # of those, taken from the store (every row)
    computed_tokens: int = 0  # prompt tokens the prefill computed (common prefixes included)
    common_prefix_tokens: int = 0  # tokens of a prefix shared by the batch, prefilled once first
    start_column: int = 0  # the column every row started from (C)
    copied_rows: int = 0  # rows whose prefix was copied (left padding), not shared
    inserted: int = 0  # rows that became store entries afterwards (one an entry already served: none)
    seconds_to_start: float = 0.0  # lookups, common prefix and take_rows, before the model's prefill


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
    reuse: ReuseReport | None = None  # prefix reuse in the last generate call with a store (None: no store)
    cascade: str = "not asked"  # under "vkv_cascade": "on", or why the last step took sdpa's path (half precision; its rows share no page or too few tokens; no attention read the tags)

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

    @property
    def mappings(self) -> int:
        """Kernel mappings the groups' reservations hold (what counts against ``vm.max_map_count``)."""
        return sum(g.mappings for g in self.groups)
