"""Rows in sub-rows: the translator of the head-major layout.

A :class:`SubRowBuffer` is a :class:`~hf_vkv.memory.virtual_buffer.VirtualBuffer` whose rows are
``blocks * heads`` page-table rows each (its *sub-rows*), all holding the same items. Sub-row
``(block g, head h)`` of row ``r`` is table row ``(g * rows + r) * heads + h``, so for one block
the sub-rows of every row and head are evenly spaced: the block's view ``[rows, heads, items]``
has ``stride(row) == heads * stride(head)`` and can be read as one ``[rows * heads, items]``
batch, exactly as a contiguous ``[B, H, T, D]`` tensor is (the cache stores a (layer, K/V) as a
block: :mod:`hf_vkv.cache.layouts.head_major`).
"""

from __future__ import annotations

from .arena import Arena
from .errors import ArgumentError
from .virtual_buffer import VirtualBuffer

__all__ = ["SubRowBuffer"]


class SubRowBuffer(VirtualBuffer):
    """``rows`` rows of ``blocks * heads`` sub-rows of up to ``capacity`` items each (see the
    module docstring). Row operations (grow, share, reorder, crop, window, fork) apply to every
    sub-row of a row; a page is shared or copied per sub-row."""

    def __init__(self, arena: Arena, *, rows: int, blocks: int, heads: int, capacity: int, item_bytes: int,
                 readable: bool = False) -> None:
        if blocks <= 0 or heads <= 0:
            raise ArgumentError(f"blocks and heads must be positive, got {blocks}, {heads}")
        self.blocks = blocks
        self.heads = heads
        super().__init__(arena, rows=rows, capacity=capacity, item_bytes=item_bytes, parts=blocks * heads,
                         readable=readable)

    def _part_rows(self, row: int) -> list[int]:
        r, h = self.rows, self.heads
        return [(g * r + row) * h + k for g in range(self.blocks) for k in range(h)]

    # view: VirtualBuffer's, which gives ``[blocks, len(rows), heads, (end - start) * item_bytes]``
    # for a buffer of sub-rows

    def _sibling(self, rows: int) -> SubRowBuffer:
        return SubRowBuffer(self.store, rows=rows, blocks=self.blocks, heads=self.heads, capacity=self.capacity,
                            item_bytes=self.item_bytes, readable=self.readable)
