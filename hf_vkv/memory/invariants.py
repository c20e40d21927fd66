"""The invariant that spans a pool and its page tables: refcounts equal table references.

A :class:`~hf_vkv.memory.pool.PagePool` checks what it knows alone (its sets are disjoint, its ids
exist, its budget holds); a :class:`~hf_vkv.memory.page_table.PageTable` checks its rows (each
covers exactly its length, and holds only pages in use). Whether a page's refcount equals the
number of table entries that hold it can only be checked by whoever knows *every* table of the
pool: a page store knows the tables of its open buffers, so
:meth:`~hf_vkv.memory.row_buffer.RowBuffer.check_invariants` calls :func:`check_pages` with them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from typing import Protocol

from .errors import InvariantError
from .pool import PageId, PagePool

__all__ = ["PageHolder", "check_pages"]


class PageHolder(Protocol):
    """What the check needs of a page table: its own check, and its entries."""

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the holder's own invariants hold."""

    def referenced_pages(self) -> Iterator[PageId]:
        """Every page held, once per table entry that holds it."""

    def held_bytes(self) -> Iterator[tuple[PageId, int]]:
        """``(page, bytes of it the entry holds)`` for every page held, once per table entry."""


def check_pages(pool: PagePool, tables: Iterable[PageHolder]) -> None:
    """Raise :class:`InvariantError` unless ``pool`` and ``tables`` (all the page tables drawing
    pages from ``pool``, and whoever else holds references on them) are consistent: the pool's and each table's own invariants hold, and
    every page's refcount equals the number of table entries, over all ``tables``, that hold it
    (plus the pool's pin of an external page),
    and no entry holds more bytes of a page than its append mark (:attr:`PagePool.marks`)."""
    pool.check_invariants()
    seen: Counter[PageId] = Counter()
    for table in tables:
        table.check_invariants()
        seen.update(table.referenced_pages())
    refs = {page: pool.refcount(page) - pool.is_external(page) for page in pool.in_use_pages()}  # less the pin
    refs = {page: n for page, n in refs.items() if n}
    if seen != refs:
        wrong = {p: (refs.get(p, 0), seen.get(p, 0)) for p in sorted(seen.keys() | refs.keys())
                 if refs.get(p, 0) != seen.get(p, 0)}
        raise InvariantError(f"refcount != occurrences in page tables (page: (refcount, seen)): "
                             f"{dict(list(wrong.items())[:8])}")
    marks = pool.marks
    if marks:
        over = [(page, held, marks[page]) for table in tables for page, held in table.held_bytes()
                if page in marks and held > marks[page]]
        if over:
            raise InvariantError(f"entries hold more bytes of a page than its append mark (page, held, mark): "
                                 f"{over[:8]}")
