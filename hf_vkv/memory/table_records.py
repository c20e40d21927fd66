"""The records of a page table: a row's table (:class:`Row`) and a copy the caller must perform
(:class:`CowCopy`). They live apart from :class:`~hf_vkv.memory.page_table.PageTable` so that the
reorder plan (:mod:`hf_vkv.memory.reorder_plan`), which builds them and which the page table calls,
imports them from here: dependencies point one way (page_table -> reorder_plan -> table_records).
"""

from __future__ import annotations

from typing import NamedTuple

from .pool import PageId

__all__ = ["EMPTY_ROW", "Row", "CowCopy"]


class Row(NamedTuple):
    """One row's table. Immutable: every operation replaces the record, so undo is a reference
    (a named tuple: a decode step replaces one per sub-row, and a tuple is the cheapest record)."""

    length: int = 0  # bytes held
    start: int = 0  # page index of pages[0]; earlier pages were dropped behind a window
    pages: tuple[PageId, ...] = ()  # pages[k] holds page index start + k

    @property
    def end(self) -> int:
        """One past the last page index held."""
        return self.start + len(self.pages)

    def page_at(self, index: int) -> PageId:
        """The page holding page index ``index`` (must be live)."""
        return self.pages[index - self.start]


#: The table of every empty row (one record: clearing 64 rows' sub-rows made 11,520 of them, each
#: one more object for the cyclic garbage collector to count).
EMPTY_ROW = Row()


class CowCopy(NamedTuple):
    """A copy the caller must perform: copy ``src`` to ``dst``, now at ``row``'s ``index``
    (a named tuple: a reorder makes one per sub-row of a beam)."""

    row: int
    index: int
    src: PageId
    dst: PageId
