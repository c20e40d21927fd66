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
  afterwards makes its layers follow the rows and lengths it now holds.

Every other group's row operations pay nothing for this.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from ..memory.errors import InvariantError
from .group import LayerGroup

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
