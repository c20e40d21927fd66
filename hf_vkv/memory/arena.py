"""Physical pages for row buffers: the :class:`PageStore` protocol and the :class:`Arena`.

A row buffer (:mod:`.rows`) keeps page tables; the page store it draws from supplies the pool
that numbers and counts the pages and does the three things that touch memory: make fresh pages
usable, copy pages (copy-on-write), and give pages back on a rollback. An :class:`Arena` is the
page store of a backend (host memfd or CUDA device memory); a
:class:`~hf_vkv.memory.block_buffer.BlockStore` is the page store of the paged layout, whose pages are
blocks inside one growing virtual buffer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Protocol

from .backend_protocol import Backend
from .errors import CacheClosedError
from .pool import PageId, PagePool

__all__ = ["Arena", "PageStore"]


class PageStore(Protocol):
    """What a row buffer needs from the memory behind its page tables."""

    pool: PagePool  # numbers, counts and budgets the pages
    closed: bool

    @property
    def page_bytes(self) -> int:
        """Bytes of one page."""

    def create(self, pages: Sequence[PageId]) -> None:
        """Make freshly allocated ``pages`` usable (called before they are written)."""

    def copy(self, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        """Copy page ``src`` to page ``dst`` for each ``(src, dst)``."""

    def release(self, pages: Sequence[PageId]) -> None:
        """Give back pages created by a transaction that is being rolled back."""

    def buffer_opened(self) -> None:
        """A buffer starts drawing from this store (raises :class:`CacheClosedError` if closed)."""

    def buffer_closed(self) -> None:
        """A buffer stopped drawing from this store; the store closes with its last buffer."""


class Arena:
    """Physical memory for one cache on one device: a backend and the pool that tracks its pages.

    Buffers (and their forks) of one arena can share pages. Freed pages stay resident and are
    recycled; :meth:`trim` gives them back. When the last buffer closes, every page is released
    and the backend closed.
    """

    def __init__(self, backend: Backend, *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < backend.page_bytes:
            raise ValueError(
                f"budget_bytes={budget_bytes:,} is smaller than one page ({backend.page_bytes:,} bytes)"
            )
        budget_pages = sys.maxsize if budget_bytes is None else budget_bytes // backend.page_bytes
        self.backend = backend
        self.pool = PagePool(page_bytes=backend.page_bytes, budget_pages=budget_pages)
        self._open_buffers = 0
        self.closed = False

    @property
    def page_bytes(self) -> int:
        return self.backend.page_bytes

    def create(self, pages: Sequence[PageId]) -> None:
        self.backend.ensure_id_space(self.pool.id_space)
        self.backend.create(pages)

    def copy(self, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        self.backend.copy(pairs)

    def release(self, pages: Sequence[PageId]) -> None:
        self.backend.release(pages)

    def trim(self, *, keep_bytes: int = 0) -> int:
        """Release resident free pages beyond ``keep_bytes``; return the bytes released."""
        pages = self.pool.take_releasable(keep_bytes // self.page_bytes)
        self.backend.release(pages)
        return len(pages) * self.page_bytes

    def buffer_opened(self) -> None:
        if self.closed:
            raise CacheClosedError("this arena was closed: its last buffer was freed; create a new cache")
        self._open_buffers += 1

    def buffer_closed(self) -> None:
        self._open_buffers -= 1
        if self._open_buffers == 0 and not self.closed:
            self.trim()
            self.closed = True
            self.backend.close()
