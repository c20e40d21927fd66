"""The layer group of the static layout: page-table work kept outside compiled steps.

In the static layout (``StaticLayer``'s contract, for ``torch.compile``) a compiled step writes
with ``index_copy_`` only, at the positions its layers' length tensors hold, into pages made
writable before it; it cannot run page-table code. So this group

* maps ahead (:meth:`StaticGroup.map_ahead`, called by ``generate`` before each step through
  :meth:`VKVCache.map_ahead`, and after every row operation that changed a page table): the next
  tokens of every row get mapped, private pages. A beam reorder that only moved bytes (each row
  kept its table, its tail's written bytes copied in) left every page, length and mapping as it
  was, each page as shared as before: it has nothing to map ahead, and the check of every
  sub-row's pages is left to the next step's call;
* learns, before a row operation, the lengths compiled steps wrote (its layers' tensors), and
  afterwards makes its layers follow the rows and lengths it now holds;
* refuses, at its first update and before it makes anything, a budget that cannot hold a row's
  whole capacity (:meth:`StaticGroup._first_buffer`): its layers' attention reads every row's
  capacity (the mask covers ``max_cache_len``), so it cannot take the smaller capacity a budget
  gives the other layouts' rows.

Every other group's row operations pay nothing for this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..memory import Arena, KVCacheOutOfMemory
from ..memory.errors import InvariantError
from .geometry import GroupGeometry
from .group import LayerGroup
from .layouts import Layout
from .oom import STORE_BUDGET

__all__ = ["StaticGroup", "StaticMember"]


class StaticMember(Protocol):
    """What the group needs of a member layer (:class:`~hf_vkv.cache.layer.VKVStaticLayer`, which
    builds on this module): the length compiled steps advance, kept by the layer."""

    layer_idx: int
    is_initialized: bool

    def written_length(self) -> int:
        """The tokens written so far, compiled steps included."""

    def set_length(self, length: int) -> None:
        """Follow the group after a row operation changed the length."""

    def follow_rows(self) -> None:
        """Follow the group after a row operation changed the batch."""


class StaticGroup(LayerGroup):
    """A :class:`LayerGroup` of :class:`StaticMember` layers (see the module docstring).
    ``map_ahead``: tokens made writable ahead of the next write."""

    def __init__(self, *, map_ahead: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ahead = map_ahead
        self.static_layers: list[StaticMember] = []  # its layers, which keep the length compiled steps advance
        self._written: int | None = None  # tokens compiled steps had written, read before a row operation
        self._moved = True  # whether the row operation running changed a page table

    def _first_buffer(self, geometry: GroupGeometry, *, rows: int, tokens: int, fit: bool = False) -> None:
        """:class:`LayerGroup`'s, but a budget that would cut a row's reservation below
        :attr:`capacity` (what its layers' ``max_cache_len`` and mask cover: attention reads the
        whole capacity) is refused first with :class:`KVCacheOutOfMemory`, nothing made: no buffer,
        no layout, no geometry, as before the first update. The other layouts reserve what the
        budget holds and run until the pool refuses a page."""
        layout = self._make_layout(geometry, len(self.members))
        arena = self._arena_for(geometry.device, layout)
        held = self._within_budget(arena.budget_bytes, tokens, geometry)
        if not fit and held < self.capacity:
            self.geometry, self.layout = None, None
            raise self._capacity_over_budget(arena, layout, rows=max(self._rows_hint or 0, rows), held=held - 1)
        super()._first_buffer(geometry, rows=rows, tokens=tokens, fit=fit)

    def _capacity_over_budget(self, arena: Arena, layout: Layout, *, rows: int, held: int) -> KVCacheOutOfMemory:
        """The refusal of :meth:`_first_buffer`: ``rows`` rows of :attr:`capacity` tokens, of which
        the budget holds ``held`` a row; ``fits_bytes`` holds them all with no page shared (as a
        call's whole need is counted, :meth:`KVCacheOutOfMemory.for_whole_call`) beside what others
        hold in the same memory."""
        stats = arena.pool.stats()
        page = stats.page_bytes
        need = rows * layout.row_parts * -(-self.capacity * layout.item_bytes // page) * page
        budget = stats.budget_pages * page
        free = max(stats.budget_pages - stats.in_use, 0) * page
        fits = stats.in_use * page + need
        where = STORE_BUDGET if self.draws_from_a_reclaimer else None  # a prefix store's memory: its budget
        raise_ = where or "cache_config['budget_bytes']"
        what = (f"layer group {self.name!r} in the static layout ({rows} row(s) of {self.capacity:,} tokens, the "
                f"capacity its attention reads whole, of which the budget holds {held:,} a row)")
        return KVCacheOutOfMemory(
            requested_bytes=need, free_bytes=free, budget_bytes=budget, what=what, fits_bytes=fits, budget=where,
            message=f"KV cache out of memory: {what} need {need:,} bytes but only {free:,} of the {budget:,}-byte "
                    f"budget are free; nothing was stored. Raise {raise_} to at least "
                    f"{fits:,}, or lower the capacity (max_new_tokens: the static layout's capacity is the call's "
                    f"max_length, or the largest an earlier static call of the model had, as StaticCache's), or "
                    f"use another layout (cache_config['layout']), whose rows take what the budget holds.")

    def attach(self, layer: StaticMember) -> None:
        """``layer`` is one of this group's members (it registers when made, or twinned by a fork)."""
        self.static_layers.append(layer)

    def _first(self) -> StaticMember | None:
        return next((layer for layer in self.static_layers if layer.is_initialized), None)

    def map_ahead(self, tokens: int | None = None) -> None:
        """Outside a compiled step: make tokens ``[length, length + max(tokens, ahead))`` of every
        row writable now (grow, copy shared pages), so the compiled step writes only into private
        pages, and sync the members' lengths with what compiled steps wrote."""
        first = self._first()
        if first is None or self.buffer is None:
            return
        length = first.written_length()
        if length == 0:
            return
        mapped = min((self.buffer.length(r) for r in range(self.batch)), default=0)
        if length > mapped:
            raise InvariantError(
                f"group {self.name!r}: compiled steps wrote up to token {length} but only {mapped} were mapped "
                f"ahead: a step ran without VKVCache.map_ahead() before it (a model whose "
                f"prepare_inputs_for_generation does not call transformers' own?); its tokens are lost")
        end = min(length + max(tokens or 0, self.ahead), self.capacity)
        self.prompts.settle()
        self.lengths = [length] * len(self.members)
        if end > length:
            self.prepare(self.batch, length, end)

    def before_row_operation(self) -> None:
        self._moved = True  # every row operation but a reorder that moved only bytes maps ahead after it
        first = self._first()
        self._written = None if first is None else first.written_length()
        if self._written is not None:
            self.lengths = [self._written] * len(self.members)

    def after_row_operation(self) -> None:
        if self._first() is None:
            return
        for layer in self.static_layers:
            if layer.is_initialized:
                length = self.length(layer.layer_idx)
                if length != self._written:  # a reorder keeps every length: no tensor write
                    layer.set_length(length)
                layer.follow_rows()
        if self._moved:
            self.map_ahead()

    def reorder(self, index: Sequence[int]) -> bool:
        self._moved = super().reorder(index)
        return self._moved

    def _twin_options(self) -> dict[str, Any]:
        return {"map_ahead": self.ahead}
