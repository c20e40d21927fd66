"""The virtual buffer: rows of a page table mapped, in order, into one reserved address range.

A :class:`VirtualBuffer` is the contiguous translator of a :class:`~hf_vkv.memory.row_buffer.RowBuffer`:
row ``r``'s item ``t`` lives at byte ``r * row_stride + t * item_bytes`` of one reservation, and
the row's physical pages are mapped there in order, so a row is an ordinary strided tensor while
its pages may be shared with other rows or other buffers of the same :class:`Arena` (forks).
A backend failure while mapping is undone with the rest of the transaction; if undoing it fails
too, the whole reservation is reset to reserved-and-unmapped in one call and the buffer closed,
so a reservation never holds a hole or a stale mapping. Before it changes a mapping, a buffer on
a backend with a mapping budget (the host's ``vm.max_map_count``) checks that the change fits
(:mod:`.map_budget`).
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from functools import lru_cache, partial
from itertools import islice
from typing import NamedTuple

import torch

from .arena import Arena
from .backend_protocol import Backend
from .interrupts import register_critical, section
from .errors import ArgumentError, ArgumentTypeError, BackendError, CacheClosedError
from .map_budget import MapBudget, mapping_change
from .page_table import PageTable, Row
from .reorder_plan import common_prefix
from .runs import is_one_run
from .pool import PageId
from .row_buffer import _CLOSED, BufferStats, RowBuffer, return_pages

__all__ = ["Arena", "VirtualBuffer", "BufferStats"]


class _Reservation:
    """A reserved address range, given back once the buffer and every view of it are gone.

    Views hold the reservation (not the buffer, which would make a cycle through its storage), so
    a buffer dropped while views of it live keeps its pages mapped until the last view goes: the
    ``closer`` (returning the pages) runs then, before the range is unreserved. An explicit
    ``close()`` runs the closer at once."""

    def __init__(self, backend: Backend, nbytes: int, *, readable: bool) -> None:
        self.budget: MapBudget | None = backend.map_budget
        if self.budget is not None:
            self.budget.check_reservation()
        self.address = backend.reserve(nbytes, readable=readable)
        self.nbytes = nbytes
        self.closer: _Closer | None = None
        self.mappings = 1  # kernel mappings the range holds now (charged to ``budget``)
        if self.budget is not None:
            self.budget.charge(1)
        # The finalizer reads the closer from the instance dict (not the instance: that would keep it alive).
        weakref.finalize(self, _release, self.__dict__, backend, self.address, nbytes)


class _Closer:
    """Unmaps a buffer's rows and returns its pages, once."""

    def __init__(self, table: PageTable, arena: Arena, address: int, row_stride: int) -> None:
        self._args: tuple[PageTable, Arena, int, int] | None = (table, arena, address, row_stride)
        self.unmapped = False  # the whole range was reset: nothing left to unmap

    def __call__(self) -> None:
        args, self._args = self._args, None
        if args is not None:
            table, arena = args[:2]
            return_pages(table, arena, None if self.unmapped else partial(_unmap_rows, *args))


@register_critical
def _release(state: dict, backend: Backend, address: int, nbytes: int) -> None:
    """A reservation's end (its finalizer, when the buffer and its last view are gone): return the
    pages still mapped in it, then give the range back, Ctrl-C held throughout (a finalizer cut
    short would keep them until the process ends). Nothing can catch an error raised here, so
    a backend that cannot free the range (a CUDA driver in a sticky error) is said in one
    ``RuntimeWarning`` naming the range, which stays reserved, instead of a traceback."""
    with section():
        try:
            if state.get("closer") is not None:
                state["closer"]()
        finally:
            if state.get("budget") is not None:
                state["budget"].charge(-state["mappings"])
            try:
                backend.unreserve(address, nbytes)
            except BackendError as exc:
                warnings.warn(f"hf_vkv could not give back the {nbytes:,}-byte address range at {address:#x} of a cache "
                              f"that is gone ({exc.call}: {exc.detail}); it stays reserved until the process ends",
                              RuntimeWarning, stacklevel=2)


class VirtualBuffer(RowBuffer):
    """``rows`` rows of up to ``capacity`` items of ``item_bytes`` bytes each, mapped on demand.

    A row's items ``[0, length)`` are readable through :meth:`view` (minus those dropped behind a
    window by :meth:`drop_before`); nothing else is mapped, and no view ever covers an unmapped
    byte.

    Invariant (besides the page table's): what is mapped at row ``r``'s page slot ``i`` is exactly
    ``table.row(r).page_at(i)`` for every live slot, and nothing at the other slots.
    """

    store: Arena
    remaps_cost = True
    #: Rows in parts are ``blocks x heads`` sub-rows (set by :class:`~hf_vkv.memory.subrow_buffer.SubRowBuffer`).
    blocks: int = 1
    heads: int = 1

    def __init__(self, arena: Arena, *, rows: int, capacity: int, item_bytes: int, parts: int = 1,
                 readable: bool = False) -> None:
        if parts != self.blocks * self.heads:
            raise ArgumentError(f"parts ({parts}) must be blocks x heads ({self.blocks} x {self.heads}): rows in "
                                "several parts are a SubRowBuffer's")
        super().__init__(arena, rows=rows, capacity=capacity, item_bytes=item_bytes, hinted=True, parts=parts)
        self.readable = readable
        self._full_views: dict[torch.dtype, torch.Tensor] = {}  # full_view's tensors, one per dtype
        self._broken = False  # a rollback failed and the reservation was reset: the buffer closes
        try:
            self.row_stride = self.pages_per_row * arena.page_bytes  # bytes between table rows
            nbytes = rows * parts * self.row_stride
            with arena.lock:  # the id space grows under the lock every page-store change holds
                arena.backend.ensure_id_space(arena.pool.id_space)
            self._reservation = _Reservation(arena.backend, nbytes, readable=readable)
            self._storage = arena.backend.tensor(self._reservation.address, nbytes, self._reservation)
        except BaseException:
            arena.buffer_closed(self._table)
            raise
        self._reservation.closer = self._finalizer = _Closer(self._table, arena, self._reservation.address,
                                                             self.row_stride)

    @property
    def address(self) -> int:
        """Virtual address of row 0, item 0."""
        return self._reservation.address

    def view(self, rows: range, start: int, end: int) -> torch.Tensor:
        """A zero-copy ``uint8`` view of items ``[start, end)`` of each row of ``rows`` (a range
        with step 1): ``[len(rows), (end - start) * item_bytes]`` (row stride ``row_stride``), or
        for a buffer of sub-rows (:class:`~hf_vkv.memory.subrow_buffer.SubRowBuffer`) ``[blocks,
        len(rows), heads, (end - start) * item_bytes]``. Valid until the next operation that
        changes those rows' pages (a write after copy-on-write goes to the new page only).

        Raises ``ValueError`` unless the items are mapped in every row. A decode step takes a view
        of every group: its cost is in the per-step overhead budget (``docs/benchmarks.md``)."""
        if self._closed:
            raise CacheClosedError(_CLOSED)
        if not isinstance(rows, range) or rows.step != 1 or not 0 <= rows.start <= rows.stop <= self.rows:
            raise ArgumentError(f"rows must be a range with step 1 inside 0..{self.rows}, got {rows!r}")
        ib, page, entries, parts = self.item_bytes, self._table.page_size, self._table.entries, self._parts
        for r in rows:
            row = entries[parts[r][0]]  # every part holds the same items
            if not 0 <= start <= end <= row.length // ib or (end > start and start * ib < row.start * page):
                raise ArgumentError(f"items [{start}, {end}) of row {r} are not mapped (it holds "
                                    f"[{self.first_live(r)}, {row.length // ib}))")
        s, n = self.row_stride, (end - start) * ib
        if self.parts == 1:
            return self._storage.as_strided((len(rows), n), (s, 1), rows.start * s + start * ib)
        blocks, heads = self.blocks, self.heads  # sub-rows: table row (g * rows + r) * heads + h
        return self._storage.as_strided((blocks, len(rows), heads, n), (self.rows * heads * s, heads * s, s, 1),
                                        rows.start * heads * s + start * ib)

    def full_view(self, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A zero-copy view ``[rows * parts, row_stride // dtype.itemsize]`` of the whole
        reservation as ``dtype``, at fixed addresses: the same tensor object for the buffer's life.
        Only a ``readable`` buffer gives one: there every byte is readable, and an item not yet on a
        real page reads as zero (writes to it are lost).

        One object per dtype, because a dtype view is a non-differentiable view in autograd (its
        ``_base`` is the tensor it was taken from): views of several layers cut from one typed
        tensor share one ``_base``, which ``torch.compile`` needs of inputs mutated in place that
        share storage (``aot_autograd`` rejects aliased inputs with different bases)."""
        if not self.readable:
            raise ArgumentTypeError("only a readable buffer (readable=True) may be viewed beyond its mapped items: "
                                    "make it with readable=True (the static layout's) or view the mapped items")
        self._open()
        full = self._full_views.get(dtype)
        if full is None:
            full = self._storage.view(self.rows * self.parts, self.row_stride).view(dtype)
            self._full_views[dtype] = full
        return full

    def stats(self) -> BufferStats:
        """:meth:`RowBuffer.stats`, with the kernel mappings the reservation holds now (the count
        charged to the mapping budget; one for an empty reservation)."""
        return dataclasses.replace(super().stats(), mappings=self._reservation.mappings)

    # ----------------------------------------------------------------------------- internals
    def _sibling(self, rows: int) -> VirtualBuffer:
        return VirtualBuffer(self.store, rows=rows, capacity=self.capacity, item_bytes=self.item_bytes,
                             readable=self.readable)

    def _slot_address(self, row: int, index: int) -> int:
        return self._reservation.address + row * self.row_stride + index * self.store.page_bytes

    def _sync(self, changed: dict[int, Row]) -> None:
        """Make the mappings of the changed rows follow the table, after checking the mapping
        budget; undo all of it on failure (see :meth:`_undo`)."""
        plan = _plan(changed, self._table)
        if not plan.rows:
            return
        reservation = self._reservation
        final = 0
        if reservation.budget is not None:
            peak, final = self._mapping_change(plan, changed)
            reservation.budget.check(peak)  # nothing changed yet: the cache stays usable
        reached = [0]
        for k, (r, first, before, after) in enumerate(plan.runs()):
            reached[0] = 0
            try:
                self._apply(r, first, after, reached)
            except BaseException as exc:
                # A failed map of several runs may have mapped a prefix of them: restore up to there.
                self._undo([*islice(plan.runs(), k), (r, first, before[:reached[0]], after[:reached[0]])], exc)
                raise
        if reservation.budget is not None:
            reservation.budget.charge(final)
            reservation.mappings += final

    def _mapping_change(self, plan: _Plan, changed: dict[int, Row]) -> tuple[int, int]:
        """``(peak, final)`` change in the kernel mappings of the reservation for ``plan``."""
        ppr, entries = self.pages_per_row, self._table.entries

        def old(g: int) -> PageId | None:
            r, slot = divmod(g, ppr)
            row = changed[r] if r in changed else entries[r]
            return row.pages[slot - row.start] if row.start <= slot < row.start + len(row.pages) else None

        return mapping_change(((r * ppr + first, before, after) for r, first, before, after in plan.runs()), old,
                              self._table.rows * ppr)

    def _undo(self, done: list, cause: BaseException) -> None:
        """Put back what ``done`` changed, newest first. If that fails too, reset the whole
        reservation in one call (nothing mapped, no hole), close the buffer once its transaction
        has rolled back (:meth:`_transaction`), and raise one error naming both causes."""
        try:
            for r, first, before, after in reversed(done):
                if before:
                    self._apply(r, first, before, [0])
        except BaseException as again:  # noqa: BLE001  (any failure here means: reset)
            self._broken = True
            try:
                self.store.backend.reset(self._reservation.address, self._reservation.nbytes)
            except BaseException:  # noqa: BLE001  (the closer still unmaps row by row)
                pass
            else:
                self._finalizer.unmapped = True
                if self._reservation.budget is not None:
                    self._reservation.budget.charge(1 - self._reservation.mappings)
                    self._reservation.mappings = 1
            detail = cause.detail if isinstance(cause, BackendError) else _detail(cause)
            raise BackendError(getattr(cause, "call", "map"),
                               f"{detail}, and restoring the mappings failed too ({_root(again)}), so "
                               f"this cache was closed and its pages returned: create a new cache") from None

    @contextmanager
    def _transaction(self) -> Iterator[PageTable]:
        """The base transaction; a buffer whose mappings could not be restored closes after it
        rolled back its table and pool."""
        try:
            with super()._transaction() as table:
                yield table
        except BaseException:
            if self._broken and not self._closed:
                self.close()
            raise

    def _apply(self, row: int, first: int, pages: Sequence[PageId | None], reached: list[int]) -> None:
        """Set slots ``first ..`` of ``row`` to ``pages`` (None = unmapped), one backend call per
        run; ``reached[0]`` says how far the calls got (the end of the run being made)."""
        backend = self.store.backend
        if pages and (type(pages) is range or None not in pages):  # a run of pages: the backend maps it in as
            # few calls as it can (``None in`` a range would compare with each id)
            reached[0] = len(pages)
            backend.map(self._slot_address(row, first), pages)  # type: ignore[arg-type]
            return
        k = 0
        while k < len(pages):
            j = k + 1
            while j < len(pages) and (pages[j] is None) == (pages[k] is None):
                j += 1
            reached[0] = j
            address = self._slot_address(row, first + k)
            if pages[k] is None:
                backend.unmap(address, j - k)
            else:
                backend.map(address, pages[k:j])  # type: ignore[arg-type]
            k = j


def _detail(exc: BaseException) -> str:
    """An error's own words, without a class name (one sentence for the combined message)."""
    return str(exc) or type(exc).__name__


def _root(exc: BaseException) -> str:
    """``call: detail`` of a backend error, else its words: never a nested chain."""
    return f"{exc.call}: {exc.detail}" if isinstance(exc, BackendError) else _detail(exc)


class _Plan(NamedTuple):
    """The runs of slots whose page changes, as parallel lists (no record per run: a repeat into
    64 rows has 11,520 runs, and a tuple each set off the cyclic garbage collector dozens of
    times a call): run ``k`` is slots ``firsts[k] ..`` of row ``rows[k]``, from pages
    ``befores[k]`` to ``afters[k]`` (``None``: unmapped)."""

    rows: list[int]
    firsts: list[int]
    befores: list[Sequence[PageId | None]]
    afters: list[Sequence[PageId | None]]

    def runs(self) -> Iterator[tuple[int, int, Sequence[PageId | None], Sequence[PageId | None]]]:
        """``(row, first slot, old pages, new pages)`` of each run, in order."""
        return zip(self.rows, self.firsts, self.befores, self.afters)


def _plan(changed: dict[int, Row], table: PageTable) -> _Plan:
    """The runs of slots whose page differs between ``changed`` (the rows' tables before) and
    ``table``, each run of new pages that is one run of consecutive ids as a ``range``, found once
    per distinct tuple (rows that repeat a row hold its very tuples: a repeat of one row of a
    head-major group into 64 maps the same 180 tuples 63 times), so that the budget's count and
    the backend's split take it in one step (:func:`~hf_vkv.memory.runs.is_one_run` of a range)."""
    entries, kept = table.entries, table.kept_prefixes()
    ranged: dict[int, Sequence[PageId | None]] = {}
    seen: list[Sequence[PageId | None]] = []  # what ``ranged`` is keyed by stays alive, so no id is reused
    plan = _Plan([], [], [], [])
    rows, firsts, befores, afters = plan
    for r, old in changed.items():
        for first, before, after in _slot_changes(old, entries[r], kept.get(r)):
            found = ranged.get(id(after))
            if found is None:
                seen.append(after)
                one_run = after and after[0] is not None and after[-1] is not None and is_one_run(after)  # type: ignore[arg-type]
                found = ranged[id(after)] = range(after[0], after[0] + len(after)) if one_run else after  # type: ignore[operator]
            rows.append(r)
            firsts.append(first)
            befores.append(before)
            afters.append(found)
    return plan


@lru_cache(maxsize=64)
def _unmapped(n: int) -> tuple[None, ...]:
    """``n`` unmapped slots (shared: rows that fill from nothing have the same count)."""
    return (None,) * n


def _slot_changes(old: Row, new: Row, kept: int | None = None
                  ) -> list[tuple[int, Sequence[PageId | None], Sequence[PageId | None]]]:
    """Runs of consecutive page slots whose page differs: ``(first slot, old pages, new pages)``.
    ``kept``: the table says the slots below it are the same in both (same start:
    :meth:`PageTable.kept_prefixes`), so they are not compared."""
    if old.start == new.start and len(old.pages) == len(new.pages) and (old.pages is new.pages or old.pages == new.pages):
        return []  # a reorder's row that kept its pages (or copied its tail in place); (a tuple's == compares
        # items before lengths: a token-major row that grew by a page was compared whole, 0.1 ms a step at 8k tokens)
    if not old.pages or not new.pages:  # a row filled from nothing (a share) or emptied: one run, no loop or copy
        return [(new.start, _unmapped(len(new.pages)), new.pages)] if new.pages else \
            [(old.start, old.pages, _unmapped(len(old.pages)))]
    k = len(old.pages)
    if old.start == new.start and len(new.pages) > k and (
            (kept is not None and kept >= old.end) or new.pages[:k] == old.pages):  # a row that grew (compared in C)
        return [(old.start + k, _unmapped(len(new.pages) - k), new.pages[k:])]
    lo = min(old.start if old.pages else new.start, new.start if new.pages else old.start)
    hi = max(old.end, new.end)
    a, b = max(old.start, new.start), min(old.end, new.end)
    if a < b:  # only the slots between the common prefix and suffix of the overlap can differ
        same = min(max(kept - a, 0), b - a) if kept is not None and old.start == new.start else 0  # known alike
        x, y = old.pages[a + same - old.start: b - old.start], new.pages[a + same - new.start: b - new.start]
        first = common_prefix(x, y)
        last = common_prefix(x[first:][::-1], y[first:][::-1]) if first < len(x) else 0  # (ends before the mismatch)
        slots = [*range(lo, a), *range(a + same + first, b - last), *range(b, hi)]
    else:
        slots = list(range(lo, hi))
    runs: list[tuple[int, list[PageId | None], list[PageId | None]]] = []
    for i in slots:
        before = old.pages[i - old.start] if old.start <= i < old.end else None
        after = new.pages[i - new.start] if new.start <= i < new.end else None
        if before == after:
            continue
        if runs and runs[-1][0] + len(runs[-1][1]) == i:
            runs[-1][1].append(before)
            runs[-1][2].append(after)
        else:
            runs.append((i, [before], [after]))
    return runs


def _unmap_rows(table: PageTable, arena: Arena, address: int, row_stride: int) -> None:
    """Unmap every live page slot of a buffer's rows (its end: see :class:`_Closer`)."""
    pages = arena.page_bytes
    for r, row in enumerate(table):
        if row.pages:
            arena.backend.unmap(address + r * row_stride + row.start * pages, len(row.pages))
