"""The page store of a backend: the :class:`Arena`.

An :class:`Arena` is the :class:`~hf_vkv.memory.page_store.PageStore` of a backend (host memfd or
CUDA device memory): the pool that numbers and counts its pages, and the backend that makes them,
copies them and gives them back.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import torch

from .backend_protocol import Backend
from .errors import BackendError, CacheOptionError
from .page_store import OpenTables, PageStore
from .pool import PageId, PagePool

__all__ = ["Arena", "PageStore"]


class Arena(OpenTables):
    """Physical memory for one cache on one device: a backend and the pool that tracks its pages.

    Buffers (and their forks) of one arena can share pages. Freed pages stay resident and are
    recycled; :meth:`trim` gives them back. When the last buffer closes, every page is released
    and the backend closed.
    """

    _name = "arena"

    def __init__(self, backend: Backend, *, budget_bytes: int | None = None) -> None:
        if budget_bytes is not None and budget_bytes < backend.page_bytes:
            raise CacheOptionError(
                f"budget_bytes={budget_bytes:,} is smaller than one page ({backend.page_bytes:,} bytes): raise "
                f"cache_config['budget_bytes'] to at least {backend.page_bytes:,} (or leave it unset: no budget)"
            )
        super().__init__()
        budget_pages = sys.maxsize if budget_bytes is None else budget_bytes // backend.page_bytes
        self.backend = backend
        self.pool = PagePool(page_bytes=backend.page_bytes, budget_pages=budget_pages)

    @property
    def page_bytes(self) -> int:
        return self.backend.page_bytes

    @property
    def budget_bytes(self) -> int | None:
        """Most bytes of pages resident at once (``None``: unbounded)."""
        pages = self.pool.budget_pages
        return None if pages == sys.maxsize else pages * self.page_bytes

    @property
    def gathered_copies(self) -> bool:
        """Whether :meth:`copy` reads every source before it writes any destination (the backend's)."""
        return self.backend.gathered_copies

    def create(self, pages: Sequence[PageId]) -> None:
        self.made_in.check("this cache's memory")
        self.backend.ensure_id_space(self.pool.id_space)
        self.backend.create(pages)

    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        self.made_in.check("this cache's memory")
        self.backend.copy(pairs, nbytes)

    def release(self, pages: Sequence[PageId]) -> None:
        if self.made_in.here:  # a forked child's finalizers leave the pages to the process that made them
            self.backend.release(pages)

    def map_file(self, fd: int, offset: int, num_pages: int, *, holds: Sequence[int] | None = None) -> range:
        """``num_pages`` external pages backed by the file open as ``fd`` from byte ``offset`` on
        (mapped read-only, never written: :meth:`PagePool.add_external`), each held by its pin
        and ``holds[i]`` references of those who will hold page ``i`` (else none: tables take
        them later); they retire when no table holds them any more. Returns their ids (a
        ``range``: consecutive). Raises :class:`BackendError` where the backend cannot map files
        (only the host backend can)."""
        map_file = getattr(self.backend, "map_file", None)
        if map_file is None:
            raise BackendError("map_file", f"the {type(self.backend).__name__} cannot map files: read the file "
                                           f"instead (a saved prefix is loaded by copy on this device)")
        self.made_in.check("this cache's memory")
        with self.lock:
            self._close_retired_files()  # a process that opens file after file keeps those still in use only
            pages = self.pool.add_external(num_pages, holds=holds)
            try:
                self.backend.ensure_id_space(self.pool.id_space)
                map_file(fd, offset, pages)
            except BaseException:
                if holds is not None:  # the holders' references go, then the pins
                    self.pool.decref([p for p, n in zip(pages, holds) for _ in range(n)])
                self.pool.retire_unheld(pages)
                raise
        return pages

    def close_retired_files(self) -> None:
        """Let the mapped files go whose every page retired (no table holds one): their
        descriptors are closed (mappings made of them stay valid)."""
        with self.lock:
            self._close_retired_files()

    def _close_retired_files(self) -> None:
        close = getattr(self.backend, "close_files", None)
        if close is not None and self.made_in.here:
            close(self.pool.all_retired)

    def read_pages(self, pages: Sequence[PageId]) -> torch.Tensor:
        """A ``uint8`` CPU copy ``[len(pages), page_bytes]`` of ``pages`` (to write them to a file)."""
        read = getattr(self.backend, "read_pages", None)
        if read is None:
            raise BackendError("read_pages", f"the {type(self.backend).__name__} cannot read pages back")
        with self.lock:
            return read(pages)

    def trim(self, *, keep_bytes: int = 0) -> int:
        """Release resident free pages beyond ``keep_bytes``; return the bytes released (none in a
        process forked after the arena was made: its pages are the other process's)."""
        if not self.made_in.here:
            return 0
        pages = self.pool.take_releasable(keep_bytes // self.page_bytes)
        self.backend.release(pages)
        return len(pages) * self.page_bytes

    def _last_closed(self) -> None:
        self.trim()
        self.backend.close()
