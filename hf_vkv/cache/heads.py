"""Head-major layer groups: each (layer, K/V, head) of a row is its own sub-row of pages.

A token-major group (:mod:`hf_vkv.cache.group`) keeps one token of every layer together, so the
keys of one head sit ``layers * 2 * heads * head_dim`` elements apart: attention reading a long
context then touches a different memory page for every token. A head-major group stores row
``r``'s ``(layer slot l, K/V c, head h)`` tokens contiguously, as physical row
``r * fanout + (l * 2 + c) * heads + h`` of a :class:`~hf_vkv.memory.VirtualBuffer` whose items
are one ``head_dim`` vector: a layer's K is the view ``[B, H, T, D]`` with ``stride(T) == D``,
laid out as a ``DynamicCache``'s, while pages are still mapped on demand and shared.

The price is page granularity: a row strands up to one partly filled page per sub-row
(``layers * 2 * heads`` of them), so this policy wants small pages (``HEAD_MAJOR_PAGE_BYTES``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..memory import BufferStats, PageTable, RowBuffer, VirtualBuffer
from .group import LayerGroup

__all__ = ["HeadMajorLayerGroup", "SubRowBuffer", "HEAD_MAJOR_PAGE_BYTES"]

#: Default host page size of head-major groups (a sub-row strands at most one page).
HEAD_MAJOR_PAGE_BYTES = 16 * 1024


class SubRowBuffer:
    """Logical rows of ``fanout`` physical rows each over one :class:`VirtualBuffer` (row ``r``
    is physical rows ``r * fanout .. r * fanout + fanout - 1``, which always hold the same number
    of items). It offers the row operations a :class:`LayerGroup` uses, applied to every sub-row."""

    def __init__(self, inner: VirtualBuffer, *, fanout: int) -> None:
        if inner.rows % fanout:
            raise ValueError(f"{inner.rows} physical rows are not a whole number of rows of {fanout}")
        self.inner = inner
        self.fanout = fanout
        self.rows = inner.rows // fanout

    def _expand(self, rows: Iterable[int]) -> list[int]:
        f = self.fanout
        return [r * f + k for r in rows for k in range(f)]

    # queries (every sub-row of a row has the same length and window)
    @property
    def arena(self) -> Any:
        return self.inner.arena

    @property
    def table(self) -> PageTable:
        return self.inner.table

    @property
    def closed(self) -> bool:
        return self.inner.closed

    def length(self, row: int) -> int:
        return self.inner.length(row * self.fanout)

    def first_live(self, row: int) -> int:
        return self.inner.first_live(row * self.fanout)

    def stats(self) -> BufferStats:
        return self.inner.stats()

    def check_invariants(self) -> None:
        self.inner.check_invariants()

    # operations
    def prepare_write(self, rows: Iterable[int], start: int, end: int) -> None:
        self.inner.prepare_write(self._expand(rows), start, end)

    def share(self, src: int, dsts: Iterable[int], *, length: int | None = None) -> None:
        dsts = list(dsts)
        for k in range(self.fanout):
            self.inner.share(src * self.fanout + k, [d * self.fanout + k for d in dsts], length=length)

    def reorder(self, index: Sequence[int]) -> None:
        self.inner.reorder(self._expand(index))

    def truncate(self, rows: Iterable[int], length: int) -> None:
        self.inner.truncate(self._expand(rows), length)

    def drop_before(self, rows: Iterable[int], item: int) -> None:
        self.inner.drop_before(self._expand(rows), item)

    def clear(self, rows: Iterable[int]) -> None:
        self.inner.clear(self._expand(rows))

    def fork(self, *, rows: int | None = None) -> SubRowBuffer:
        return SubRowBuffer(self.inner.fork(rows=None if rows is None else rows * self.fanout), fanout=self.fanout)

    def close(self) -> None:
        self.inner.close()


class HeadMajorLayerGroup(LayerGroup):
    """A :class:`LayerGroup` stored head-major (see the module docstring)."""

    def _new_buffer(self, *, rows: int, item_bytes: int) -> RowBuffer:
        g = self.geometry
        assert g is not None
        fanout = len(self.members) * 2 * g.kv_heads
        inner = VirtualBuffer(self._arena_for(g.device), rows=rows * fanout, capacity=self.capacity,
                              item_bytes=g.head_dim * g.dtype.itemsize)
        return SubRowBuffer(inner, fanout=fanout)  # type: ignore[return-value]  (the row operations LayerGroup uses)

    def view(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the active rows, typed: ``[B, layers, 2, H, T, D]``."""
        typed = self._views.get((start, end))
        if typed is None:
            g = self.geometry
            buffer = self._buf()
            assert g is not None and isinstance(buffer, SubRowBuffer)
            raw = buffer.inner.view(range(self.batch * buffer.fanout), start, end)  # [B * fanout, T * D bytes]
            typed = raw.view(g.dtype).view(self.batch, len(self.members), 2, g.kv_heads, end - start, g.head_dim)
            self._views[(start, end)] = typed
        return typed

    def _store(self, slot: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor,
               rows: list[int] | None) -> None:
        store = self.view(start, start + key_states.shape[2])[:, slot]  # [B, 2, H, q, D]
        if rows is None:
            store[:, 0].copy_(key_states)
            store[:, 1].copy_(value_states)
            return
        for row in rows:
            store[row, 0].copy_(key_states[row])
            store[row, 1].copy_(value_states[row])

    def states(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy ``[B, H, T, D]`` views (``stride(T) == D``) of ``layer`` over ``[start, end)``."""
        block = self.view(start, end)[:, self.slot[layer]]  # [B, 2, H, T, D]
        return block[:, 0], block[:, 1]
