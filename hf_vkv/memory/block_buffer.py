"""The paged translator: rows hold block tables into a pool of blocks that stay where they are.

A :class:`BlockStore` keeps fixed-size blocks (``block_bytes`` each; for the cache, a block is
``block_tokens`` tokens of a layer group) one after another in a single-row
:class:`~hf_vkv.memory.virtual_buffer.VirtualBuffer`, so the pool of blocks itself grows on demand, page
by page, and block ``b`` is row ``b`` of one ``[num_blocks, block_bytes]`` tensor. A
:class:`BlockBuffer` is a :class:`~hf_vkv.memory.row_buffer.RowBuffer` over such a store: sharing,
reorders, copy-on-write, forks, crops and windows are the same page-table operations as in the
contiguous layout, but nothing is ever remapped: a paged attention kernel reads the rows through
:meth:`BlockBuffer.block_tables`.

Block ids are dense (the store grows to the highest id in use, and freed blocks are recycled
before fresh ones are taken), so the store's memory is the high-water mark of blocks in use.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import torch

from .arena import Arena
from .errors import ArgumentError, CacheClosedError
from .page_store import OpenTables
from .page_table import Row
from .pool import PageId, PagePool
from .row_buffer import RowBuffer, return_pages
from .virtual_buffer import VirtualBuffer

__all__ = ["BlockStore", "BlockBuffer"]


class BlockStore(OpenTables):
    """Up to ``max_blocks`` blocks of ``block_bytes`` bytes in pages of ``arena`` (a page store
    for :class:`BlockBuffer`; see the module docstring).

    Invariant: every block id in use is below the number of blocks the store has grown to, so
    :meth:`blocks` covers every block a table holds. The arena's budget bounds the store's
    growth; ``max_blocks`` bounds its reservation (address space only).
    """

    _name = "block store"
    #: :meth:`copy` gathers every source block before it writes any (one index_select).
    gathered_copies = True

    def __init__(self, arena: Arena, *, block_bytes: int, max_blocks: int) -> None:
        if block_bytes <= 0 or max_blocks <= 0:
            raise ArgumentError(f"block_bytes and max_blocks must be positive, got {block_bytes}, {max_blocks}")
        super().__init__()
        self.block_bytes = block_bytes
        self.max_blocks = max_blocks
        # The store's capacity is the pool's budget: a request for more blocks than it can hold
        # raises KVCacheOutOfMemory before any table changes.
        self.pool = PagePool(page_bytes=block_bytes, budget_pages=max_blocks)
        self._store = VirtualBuffer(arena, rows=1, capacity=max_blocks, item_bytes=block_bytes)
        self._view: torch.Tensor | None = None

    @property
    def page_bytes(self) -> int:
        return self.block_bytes

    @property
    def num_blocks(self) -> int:
        """Blocks the store has grown to (those :meth:`blocks` covers)."""
        return 0 if self.closed else self._store.length(0)

    def blocks(self) -> torch.Tensor:
        """A zero-copy ``uint8`` tensor ``[num_blocks, block_bytes]``: block ``b`` is row ``b``
        (valid until the store grows or closes)."""
        if self._view is None:
            if self.closed:
                raise CacheClosedError("this block store was closed with its last buffer; create a new cache")
            n = self._store.length(0)
            self._view = self._store.view(range(1), 0, n).view(n, self.block_bytes)
        return self._view

    # ----------------------------------------------------------------------------- PageStore
    def create(self, pages: Sequence[PageId]) -> None:
        need = max(pages) + 1
        if need > self._store.length(0):
            self._store.grow([0], need)  # may raise KVCacheOutOfMemory: the caller's transaction rolls back
            self._view = None

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        # whole blocks (a block is a few KiB: one gathered copy beats per-block slices)
        if pairs:
            blocks = self.blocks()
            if blocks.device.type == "cpu" and not self.block_bytes % 8:
                blocks = blocks.view(torch.int64)  # CPU copies of 8-byte words are ~6x faster than of bytes
            src = torch.tensor([s for s, _ in pairs], device=blocks.device)
            dst = torch.tensor([d for _, d in pairs], device=blocks.device)
            blocks.index_copy_(0, dst, blocks.index_select(0, src))

    def release(self, pages: Sequence[PageId]) -> None:
        """Blocks of a rolled-back transaction stay in the store (its memory is a high-water
        mark); they are free ids again once the pool is rolled back."""

    def _last_closed(self) -> None:
        self._view = None
        self._store.close()


class BlockBuffer(RowBuffer):
    """Rows of a page table whose pages are blocks of a :class:`BlockStore` (the paged layout).

    A block holds ``block_items = store.block_bytes // item_bytes`` items; row ``r``'s item ``t``
    is item ``t % block_items`` of block ``table.row(r).page_at(t // block_items)``.
    """

    store: BlockStore

    def __init__(self, store: BlockStore, *, rows: int, capacity: int, item_bytes: int) -> None:
        if store.block_bytes % item_bytes:
            raise ArgumentError(f"a block of {store.block_bytes} bytes does not hold whole items of {item_bytes} bytes")
        super().__init__(store, rows=rows, capacity=capacity, item_bytes=item_bytes, hinted=False)
        self.block_items = store.block_bytes // item_bytes
        self._finalizer = weakref.finalize(self, return_pages, self._table, store)

    def block_tables(self, rows: range) -> torch.Tensor:
        """int32 ``[len(rows), max blocks]``: entry ``j`` of a row is the block holding its items
        ``[j * block_items, (j + 1) * block_items)``; entries before the row's first live block
        (dropped behind a window) and past its last are 0 and must not be read."""
        table = self._open()
        held = [table.row(r) for r in rows]
        width = max((row.end for row in held), default=0)
        out = [[0] * row.start + list(row.pages) + [0] * (width - row.end) for row in held]
        return torch.tensor(out, dtype=torch.int32).reshape(len(held), width)

    def _sibling(self, rows: int) -> BlockBuffer:
        return BlockBuffer(self.store, rows=rows, capacity=self.capacity, item_bytes=self.item_bytes)

    def _sync(self, changed: dict[int, Row]) -> None:
        """Nothing to translate: kernels read the tables."""

