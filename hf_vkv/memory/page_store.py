"""What a row buffer needs from the memory behind its page tables, and the bookkeeping of the
buffers open on it that every such page store shares.

A row buffer (:mod:`.row_buffer`) keeps a page table; the page store it draws from supplies the
pool that numbers and counts the pages and does the three things that touch memory: make fresh
pages usable, copy pages (copy-on-write), and give pages back on a rollback. Two stores exist: the
:class:`~hf_vkv.memory.arena.Arena` of a backend, and the
:class:`~hf_vkv.memory.block_buffer.BlockStore` of the paged layout.

A store also knows the page tables of the buffers open on it (:class:`OpenTables`): it closes with
the last of them, and it is the one place that can check that each page's refcount equals the
number of table entries holding it (:func:`~hf_vkv.memory.invariants.check_pages`). Whoever else
holds references on its pages outside any table (a mapped prefix file's entry before a cache
installs it) registers as a holder for that time (:meth:`OpenTables.hold`), so the check counts
those references too.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Protocol

from .errors import CacheClosedError
from .interrupts import SectionLock
from .invariants import PageHolder
from .process import MadeIn, made_here
from .page_table import PageTable
from .pool import PageId, PagePool

__all__ = ["OpenTables", "PageStore"]


class PageStore(Protocol):
    """What a row buffer needs from the memory behind its page tables."""

    pool: PagePool  # numbers, counts and budgets the pages
    closed: bool
    gathered_copies: bool  # copy() reads every source before it writes any destination
    lock: SectionLock  # held by every transaction on the store's tables and pool (threads sharing pages; Ctrl-C waits)
    made_in: MadeIn  # the process that made it: no other changes its pages

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""

    def create(self, pages: Sequence[PageId]) -> None:
        """Make freshly allocated ``pages`` usable (called before they are written)."""

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        """Copy page ``src`` to page ``dst`` for each ``(src, dst)``: its first ``nbytes[k]``
        bytes (the part written so far), or the whole page when ``nbytes`` is None. A page may
        be the ``src`` of one pair and the ``dst`` of a later one, never the reverse: run the copies
        in order, or read every source before writing any destination (one batched copy); with
        ``gathered_copies`` it does the latter, and pairs may then form cycles."""

    def release(self, pages: Sequence[PageId]) -> None:
        """Give back pages created by a transaction that is being rolled back."""

    def buffer_opened(self, table: PageTable) -> None:
        """A buffer with page table ``table`` starts drawing from this store (raises
        :class:`CacheClosedError` if the store is closed)."""

    def buffer_closed(self, table: PageTable) -> None:
        """The buffer of ``table`` stopped drawing from this store (its rows are empty, unless
        the store was closed); the store closes with its last buffer."""

    def tables(self) -> list[PageTable]:
        """The page tables of the buffers open on this store: every table drawing from ``pool``."""

    def holders(self) -> list[PageHolder]:
        """Every holder of references on ``pool``'s pages: the :meth:`tables`, and the holders
        outside any table (:meth:`OpenTables.hold`)."""


class OpenTables(ABC):
    """The open-buffer bookkeeping of a page store: the tables of its open buffers, and closing
    with the last one (:meth:`_last_closed` says what closing does).

    Invariant: ``closed`` is False while any buffer is open, and never goes back to False.

    ``made_in``: the process that made the store; in a process forked from it, no buffer opens,
    changes or writes pages (:class:`~hf_vkv.memory.process.ForkedMemoryError`), and nothing is
    given back to the backend (the pages are the other process's: :mod:`hf_vkv.memory.process`).

    ``lock`` serializes the changes of the store's pool and tables: caches of two threads that
    share pages (a prefix store's entries and the requests forked from them) draw from one store,
    and a pool transaction is not reentrant across threads.
    """

    _name = "page store"  # what errors call the store

    def __init__(self) -> None:
        self._tables: dict[int, PageTable] = {}  # id(table) -> table, in opening order
        self._holders: dict[int, PageHolder] = {}  # id(holder) -> holder outside any table
        self.closed = False
        self.lock = SectionLock()  # held, it holds Ctrl-C too (:mod:`hf_vkv.memory.interrupts`)
        self.made_in = made_here()  # a forked child never changes it (:mod:`hf_vkv.memory.process`)

    def buffer_opened(self, table: PageTable) -> None:
        self.made_in.check(f"this {self._name}")
        if self.closed:
            raise CacheClosedError(f"this {self._name} was closed with its last buffer; create a new cache")
        self._tables[id(table)] = table

    def buffer_closed(self, table: PageTable) -> None:
        self._tables.pop(id(table), None)
        if not self._tables and not self.closed:
            self.closed = True
            self._last_closed()

    def tables(self) -> list[PageTable]:
        return list(self._tables.values())

    def hold(self, holder: PageHolder) -> None:
        """``holder`` holds references on this store's pages outside any page table (taken with
        the pool's own calls), until :meth:`let_go`; :meth:`holders` lists it meanwhile."""
        self._holders[id(holder)] = holder

    def let_go(self, holder: PageHolder) -> None:
        """``holder`` no longer holds references outside a table (whether it ever did or not)."""
        self._holders.pop(id(holder), None)

    def holders(self) -> list[PageHolder]:
        return [*self._tables.values(), *self._holders.values()]

    @abstractmethod
    def _last_closed(self) -> None:
        """Release the store's memory: its last buffer closed."""
