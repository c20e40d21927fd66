"""The physical page pool: ids, reference counts, free lists and a budget. Pure bookkeeping.

A page is a fixed-size unit of physical memory named by a :data:`PageId`. The pool does not know
what a page is made of (a slice of a memfd, a CUDA allocation, a block of a paged pool): a backend
does. Each page is in exactly one of three states:

* **in use**: referenced by one or more page-table entries (``refcount >= 1``);
* **resident free**: unreferenced but still backed by memory, recycled before new memory is touched
  (first-touching memory costs far more than mapping it, see ``docs/notes/vmm.md`` §6);
* **not resident**: never created, or released (hole punched / handle released).

A page in use may carry an **append mark** (:attr:`PagePool.marks`): no table entry holds more
than that many bytes of the page, so the entry that holds exactly that many may write the bytes
after them in place although the page is shared (nobody else holds them), and the mark advances.
A shared page without a mark is copied on write. Page tables set and advance marks (a row that
starts from a stored entry's page marks it, see :meth:`~hf_vkv.memory.row_buffer.RowBuffer.adopt`);
freeing a page drops its mark.

A page may be **external** (:meth:`PagePool.add_external`): a page of a file mapped read-only
(a saved prefix), never written. The pool holds one reference of its own to each external page
(the *pin*), so a table entry never finds one unshared and never writes it in place: a row that
writes into it gets a copy. When the last table entry lets it go, only the pin is left and the page
**retires**: its id is never handed out again (the backend keeps it pointing into the file).

Ids live in an id space that grows by *segments*. A page table asks for pages with *hints* (the id
after the row's previous page, then the page index's home id in its segment), so a row's consecutive
pages usually sit at consecutive physical offsets and the host backend maps them with one call.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, islice, repeat
from operator import add, not_, sub
from types import MappingProxyType
from typing import NewType

from .errors import ArgumentError, InvariantError, KVCacheOutOfMemory

__all__ = ["PageHints", "PageId", "PagePool", "PoolStats"]

PageId = NewType("PageId", int)


@dataclass(slots=True, frozen=True)
class PoolStats:
    """A snapshot of a pool's counters."""

    page_bytes: int  # bytes of one page
    budget_pages: int  # most pages that may be resident at once
    in_use: int  # pages referenced by at least one table entry
    resident_free: int  # unreferenced pages still backed by memory
    created: int  # pages made resident from nothing, over the pool's life
    recycled: int  # allocations served by a resident free page
    released: int  # resident free pages given back to the system
    id_space: int  # ids handed out to segments so far
    external: int = 0  # pages of mapped files some table holds (not in ``in_use``: the file's memory)

    @property
    def resident(self) -> int:
        """Pages backed by memory now (in use + resident free)."""
        return self.in_use + self.resident_free

    @property
    def resident_bytes(self) -> int:
        return self.resident * self.page_bytes

    @property
    def in_use_bytes(self) -> int:
        return self.in_use * self.page_bytes


class PageHints:
    """The preferred ids of the pages one :meth:`PagePool.allocate` takes, best first: ``first[i]``
    then ``second[i]`` for page ``i`` (a negative id: no preference). Two flat lists of ints,
    which the cyclic garbage collector does not track: a list per page made a prefill's thousands
    of pages trigger it again and again (and, with a model's objects on the heap, a full
    collection every few calls)."""

    __slots__ = ("first", "second")

    def __init__(self) -> None:
        self.first: list[int] = []
        self.second: list[int] = []

    def __len__(self) -> int:
        return len(self.first)

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return zip(self.first, self.second)


class PagePool:
    """Reference-counted physical pages under a budget.

    Invariants (checked by :meth:`check_invariants`):

    * every id is < ``id_space``; in-use and resident-free ids are disjoint;
    * ``refcount[p] >= 1`` for every in-use page;
    * ``in_use + resident_free <= budget_pages``: resident memory never exceeds the budget;
    * every append mark is of a page in use, not external, and in ``(0, page_bytes]``;
    * an external page is in use (its pin counts: ``refcount >= 1``) or retired, never resident
      free; a retired page is neither in use nor resident free, and is never allocated again. That no entry holds more
      bytes of a page than its mark spans the tables: :func:`~hf_vkv.memory.invariants.check_pages`.

    Mutations can run inside a transaction (:meth:`begin` / :meth:`commit` / :meth:`rollback`); a
    rollback restores every counter and set exactly, so a failed backend call leaves no trace.

    That a refcount equals the number of page-table entries holding the page spans the pool and
    every table drawing from it: :func:`~hf_vkv.memory.invariants.check_pages` checks it.
    """

    def __init__(self, *, page_bytes: int, budget_pages: int) -> None:
        if page_bytes <= 0:
            raise ArgumentError(f"page_bytes must be positive, got {page_bytes}")
        if budget_pages < 0:
            raise ArgumentError(f"budget_pages must be >= 0, got {budget_pages}")
        self.page_bytes = page_bytes
        self.budget_pages = budget_pages
        self._refs: dict[PageId, int] = {}
        #: ``{page: refcount}`` of the pages in use, read-only and live (a page table's decode fast
        #: path reads it directly: no call per page; a page is shared when its count is above 1).
        self.refs: Mapping[PageId, int] = MappingProxyType(self._refs)
        # Insertion-ordered set, oldest first. An OrderedDict, not a dict: taking the oldest entry
        # of a dict again and again scans the holes its deletions left (quadratic on large pools).
        self._resident_free: OrderedDict[PageId, None] = OrderedDict()
        self._id_space = 0
        self._cursor = 0  # where the search for an unhinted fresh id resumes
        self._created = 0
        self._recycled = 0
        self._released = 0
        self._undo: list[Callable[[], None]] | None = None
        #: ``{page: append mark}`` (module docstring), read and advanced in place by a page table's
        #: decode fast path (under its store's lock); elsewhere change it with :meth:`set_marks`.
        #: Only pages in use have marks (a freed page's goes).
        self.marks: dict[PageId, int] = {}
        self._external: set[PageId] = set()  # pinned pages of mapped files (in use or retired)
        self._retired: set[PageId] = set()  # external pages no table holds any more: never reused

    # ----------------------------------------------------------------------------- transactions
    def begin(self) -> None:
        """Start recording undo steps. Transactions do not nest."""
        if self._undo is not None:
            raise InvariantError("PagePool.begin() inside an open transaction")
        self._undo = []

    def commit(self) -> None:
        """Keep the changes since :meth:`begin`."""
        self._undo = None

    def rollback(self) -> None:
        """Undo every change since :meth:`begin`, newest first."""
        undo, self._undo = self._undo or [], None
        for step in reversed(undo):
            step()

    def keep_resident(self, pages: Iterable[PageId]) -> None:
        """After a rollback: ``pages`` (created by the rolled-back transaction, unreferenced) could
        not be given back, so they stay resident free and are recycled, never created again. Within
        the budget: the transaction held them in use."""
        if self._undo is not None:
            raise InvariantError("PagePool.keep_resident() inside an open transaction")
        for page in pages:
            if page in self._refs:
                raise InvariantError(f"page {page} is in use: it cannot be kept as a free page")
            self._resident_free[page] = None

    def _record(self, step: Callable[[], None]) -> None:
        if self._undo is not None:
            self._undo.append(step)

    def _restore_ref(self, page: PageId, count: int) -> None:
        if count:
            self._refs[page] = count
        else:
            self._refs.pop(page, None)

    def _bump(self, name: str, delta: int) -> None:
        setattr(self, name, getattr(self, name) + delta)
        self._record(lambda: setattr(self, name, getattr(self, name) - delta))

    # ----------------------------------------------------------------------------- id space
    def add_segment(self, num_pages: int) -> PageId:
        """Extend the id space by ``num_pages`` ids and return the first one (a segment's base)."""
        if num_pages < 0:
            raise ArgumentError(f"num_pages must be >= 0, got {num_pages}")
        base = self._id_space
        self._bump("_id_space", num_pages)
        return PageId(base)

    def add_external(self, num_pages: int, *, holds: Sequence[int] | None = None) -> range:
        """A new segment of ``num_pages`` external pages (module docstring), each in use with
        its pin (refcount 1) and, with ``holds``, ``holds[i]`` references more on page ``i``
        (those of whoever will hold it: one pass, where :meth:`incref` per holder made a pass
        each); a page with ``holds[i] == 0`` retires at once. Without ``holds`` every page waits
        for table entries (:meth:`incref`). Outside the budget: their memory is the file's (the
        page cache), not the pool's. Raises :class:`InvariantError` inside a transaction (a
        mapped file is opened on its own) and ``ValueError`` for ``holds`` of another length or
        with a negative count. Returns the pages' ids: a ``range``, as they are consecutive."""
        if self._undo is not None:
            raise InvariantError("PagePool.add_external() inside an open transaction")
        low = min(holds) if holds else 0
        if holds is not None and (len(holds) != num_pages or low < 0):
            raise ArgumentError(f"holds must give a count >= 0 for each of the {num_pages} pages")
        base = self.add_segment(num_pages)
        pages = range(base, base + num_pages)  # consecutive ids (PageId is an int at run time)
        self._external.update(pages)
        if holds is None or (low > 0 and low == max(holds)):  # each page held alike (one entry)
            self._refs.update(dict.fromkeys(pages, 1 + low))
        else:
            held = list(compress(pages, holds))  # (iterators in C: a file has thousands of pages)
            self._refs.update(zip(held, map(add, compress(holds, holds), repeat(1))))
            if len(held) < num_pages:
                self._retired.update(compress(pages, map(not_, holds)))
        return pages

    def all_retired(self, lo: PageId, hi: PageId) -> bool:
        """Whether every page ``lo..hi`` (external pages of one file) is retired: no table holds
        any, and none is handed out again (its file may be let go)."""
        retired = self._retired
        return all(page in retired for page in range(lo, hi + 1))

    def retire_unheld(self, pages: Iterable[PageId]) -> list[PageId]:
        """Retire the external ``pages`` that no table entry holds (only the pin left), e.g. a
        mapped file's pages no entry took; return them."""
        if self._undo is not None:
            raise InvariantError("PagePool.retire_unheld() inside an open transaction")
        out = [p for p in pages if p in self._external and self._refs.get(p) == 1]
        for p in out:
            del self._refs[p]
        self._retired.update(out)
        return out

    def is_external(self, page: PageId) -> bool:
        """Whether ``page`` is a page of a mapped file (in use, or retired)."""
        return page in self._external

    @property
    def external_in_use(self) -> int:
        """External pages some table entry holds now."""
        return len(self._external) - len(self._retired)

    @property
    def id_space(self) -> int:
        """Number of page ids that exist (resident or not)."""
        return self._id_space

    # ----------------------------------------------------------------------------- allocation
    def allocate(self, hints: Sequence[Sequence[int]]) -> tuple[list[PageId], list[PageId]]:
        """Take one page per entry of ``hints``, each with refcount 1.

        ``hints[i]`` lists preferred ids for page ``i``, best first (a negative id: no preference;
        :class:`PageHints`). A free hinted id is taken if
        taking it keeps resident memory within the budget; else a resident free page is recycled;
        else a fresh id is made resident.

        Returns ``(pages, created)``: the pages in order, and those among them that must be made
        resident by the backend before use. Raises :class:`KVCacheOutOfMemory` with nothing
        changed when fewer than ``len(hints)`` pages fit in the budget.
        """
        n = len(hints)
        if n == 0:
            return [], []
        in_use = len(self._refs) - self.external_in_use
        if in_use + n > self.budget_pages:
            raise KVCacheOutOfMemory(
                requested_bytes=n * self.page_bytes,
                free_bytes=(self.budget_pages - in_use) * self.page_bytes,
                budget_bytes=self.budget_pages * self.page_bytes,
            )
        pages: list[PageId] = []
        created: list[PageId] = []
        recycled: list[PageId] = []
        try:
            for wanted in hints:
                page = self._take(wanted)
                if page in self._resident_free:
                    del self._resident_free[page]
                    recycled.append(page)
                else:
                    created.append(page)
                self._refs[page] = 1
                pages.append(page)
        finally:  # one undo step for every page (a prefill allocates thousands)
            self._created += len(created)
            self._recycled += len(recycled)
            if pages:
                self._record(lambda: self._undo_allocate(pages, created, recycled))
        return pages, created

    def set_marks(self, marks: Mapping[PageId, int]) -> None:
        """Set the append marks of ``marks``' pages (one undo step)."""
        if marks:
            old = {page: self.marks.get(page) for page in marks}
            self.marks.update(marks)
            self._record(lambda: self._restore_marks(old))

    def drop_marks(self, pages: Iterable[PageId]) -> None:
        """Forget the append marks of ``pages`` (they are copied on write when shared again)."""
        old = {page: self.marks.pop(page) for page in pages if page in self.marks}
        if old:
            self._record(lambda: self.marks.update(old))

    def _restore_marks(self, old: Mapping[PageId, int | None]) -> None:
        for page, mark in old.items():
            if mark is None:
                self.marks.pop(page, None)
            else:
                self.marks[page] = mark

    def _undo_allocate(self, pages: list[PageId], created: list[PageId], recycled: list[PageId]) -> None:
        for page in pages:
            self._refs.pop(page, None)
        for page in recycled:
            self._resident_free[page] = None
        self._created -= len(created)
        self._recycled -= len(recycled)

    def _take(self, wanted: Sequence[PageId]) -> PageId:
        room = len(self._refs) - self.external_in_use + len(self._resident_free) < self.budget_pages
        retired = self._retired
        for page in wanted:
            if 0 <= page < self._id_space and page not in self._refs and page not in retired:
                if page in self._resident_free or room:
                    return page
        if self._resident_free:  # touching fresh memory costs far more than recycling
            return next(iter(self._resident_free))
        return self._fresh_id()

    def _fresh_id(self) -> PageId:
        """A free id that is not resident, scanning round the id space from a cursor."""
        space = self._id_space
        for step in range(space):
            page = PageId((self._cursor + step) % space)
            if page not in self._refs and page not in self._resident_free and page not in self._retired:
                self._cursor = (page + 1) % space
                return page
        if self._resident_free:
            return next(iter(self._resident_free))
        raise InvariantError("page id space exhausted: a segment was not added for a page table")

    def incref(self, pages: Iterable[PageId]) -> None:
        """Add one reference to each page (all must be in use). One undo step for all of them:
        a closure per page made forking a long row trigger the cyclic garbage collector again and
        again (5x slower with a model's objects on the heap)."""
        refs = self._refs
        pages = pages if isinstance(pages, (list, tuple)) else list(pages)
        counts = list(map(refs.get, pages, repeat(0)))  # checked first, in C: nothing changes on an error
        if 0 in counts:
            raise InvariantError(f"incref of page {pages[counts.index(0)]}, which is not in use")
        if len(set(pages)) == len(pages):  # the common case: distinct pages
            refs.update(zip(pages, map(add, counts, repeat(1))))
            if pages:
                self._record(lambda: refs.update(zip(pages, counts)))
            return
        old = {page: refs[page] for page in pages}  # a page more than once gains a reference each time
        refs.update({page: old[page] + n for page, n in Counter(pages).items()})
        self._record(lambda: refs.update(old))

    def decref(self, pages: Iterable[PageId]) -> list[PageId]:
        """Drop one reference from each page; return the pages that became free (kept resident).
        One undo step for all of them, as :meth:`incref` (closing or clearing a long head-major
        row drops thousands)."""
        refs, freed, retired = self._refs, [], []
        old_pages: list[PageId] = []  # what each page held before, in two lists of ints: a tuple per page
        old_counts: list[int] = []  # made closing a long row trigger the cyclic garbage collector
        pages = pages if isinstance(pages, (list, tuple)) else list(pages)
        counts = list(map(refs.get, pages, repeat(0)))
        if counts and min(counts) >= 3 and len(set(pages)) == len(pages):
            # the common case of a shared page's holder letting go (an entry of a store, a mapped
            # file's pins): no page frees or retires, so every count drops by one, in C
            refs.update(zip(pages, map(sub, counts, repeat(1))))
            self._record(lambda: refs.update(zip(pages, counts)))
            return freed
        try:
            for page in pages:
                count = refs.get(page, 0)
                if count == 0:
                    raise InvariantError(f"decref of page {page}, which is not in use")
                old_pages.append(page)
                old_counts.append(count)
                if count == 1:
                    del refs[page]
                    self._resident_free[page] = None
                    freed.append(page)
                    self.marks.pop(page, None)  # (not restored by a rollback: no mark is always safe)
                elif count == 2 and page in self._external:
                    del refs[page]  # only the pin was left: the page retires
                    self._retired.add(page)
                    retired.append(page)
                else:
                    refs[page] = count - 1
        finally:
            if old_pages:
                self._record(lambda: self._undo_decref(old_pages, old_counts, freed, retired))
        return freed

    def _undo_decref(self, pages: list[PageId], counts: list[int], freed: list[PageId], retired: list[PageId]) -> None:
        for page in freed:
            self._resident_free.pop(page, None)
        self._retired.difference_update(retired)
        for page, count in zip(reversed(pages), reversed(counts)):
            self._restore_ref(page, count)

    def adjust(self, delta: Mapping[PageId, int]) -> None:
        """Add ``delta[p]`` references to each page ``p`` (negative: drop them), in one pass: what
        a reorder moves, netted per page. Every page must be in use and keep a count >= 0; a page
        whose count reaches 0 becomes free (kept resident). All or nothing (checked first), with
        one undo step for every page: a reorder of head-major rows moves thousands."""
        refs = self._refs
        bad = [(p, refs.get(p, 0), d) for p, d in delta.items() if d and (p not in refs or refs[p] + d < 0)]
        if bad:
            page, count, d = bad[0]
            raise InvariantError(f"page {page} with {count} references cannot take {d:+d}")
        old = {p: refs[p] for p, d in delta.items() if d}
        if not old:
            return
        freed = [p for p, count in old.items() if count + delta[p] == 0]
        external = self._external
        retired = [p for p, count in old.items() if count + delta[p] == 1 and p in external] if external else []
        refs.update({p: count + delta[p] for p, count in old.items()})
        for p in freed:
            del refs[p]
            self._resident_free[p] = None
            self.marks.pop(p, None)
        for p in retired:  # only the pin was left
            del refs[p]
            self._retired.add(p)
        self._record(lambda: self._undo_adjust(old, freed, retired))

    def _undo_adjust(self, old: dict[PageId, int], freed: list[PageId], retired: list[PageId]) -> None:
        for p in freed:
            self._resident_free.pop(p, None)
        self._retired.difference_update(retired)
        self._refs.update(old)

    def refcount(self, page: PageId) -> int:
        """References to ``page`` (0 when free)."""
        return self._refs.get(page, 0)

    def is_shared(self, page: PageId) -> bool:
        """Whether more than one table entry holds ``page`` (a write to it needs copy-on-write)."""
        return self._refs.get(page, 0) > 1

    def take_releasable(self, keep: int = 0) -> list[PageId]:
        """Remove all but ``keep`` resident free pages (oldest first) and return them for release
        (one undo step for all of them: a closed prefill's cache hands back thousands)."""
        free = self._resident_free
        out = list(islice(free, max(len(free) - max(keep, 0), 0)))
        for page in out:
            del free[page]
        if out:  # a rollback re-inserts them at the end: recycle order is no state that matters
            self._record(lambda: free.update(dict.fromkeys(out)))
        self._bump("_released", len(out))
        return out

    # ----------------------------------------------------------------------------- inspection
    def stats(self) -> PoolStats:
        """Current counters."""
        return PoolStats(
            page_bytes=self.page_bytes,
            budget_pages=self.budget_pages,
            in_use=len(self._refs) - self.external_in_use,
            resident_free=len(self._resident_free),
            created=self._created,
            recycled=self._recycled,
            released=self._released,
            id_space=self._id_space,
            external=self.external_in_use,
        )

    def in_use_pages(self) -> set[PageId]:
        """The ids of every page in use."""
        return set(self._refs)

    def resident_free_pages(self) -> set[PageId]:
        """The ids of every resident free page."""
        return set(self._resident_free)

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless every invariant in the class docstring holds."""
        if self._undo is not None:
            raise InvariantError("check_invariants() inside an open transaction")
        both = self._refs.keys() & self._resident_free.keys()
        if both:
            raise InvariantError(f"pages both in use and free: {sorted(both)[:8]}")
        for page, count in self._refs.items():
            if count < 1 or not 0 <= page < self._id_space:
                raise InvariantError(f"page {page} has refcount {count} (id space {self._id_space})")
        for page in self._resident_free:
            if not 0 <= page < self._id_space:
                raise InvariantError(f"free page {page} outside the id space {self._id_space}")
        own = len(self._refs) - self.external_in_use
        if own + len(self._resident_free) > self.budget_pages:
            raise InvariantError(
                f"{own} in use + {len(self._resident_free)} resident free pages exceed the budget of {self.budget_pages}"
            )
        if self._retired - self._external or self._retired & (self._refs.keys() | self._resident_free.keys()):
            raise InvariantError("a retired page is not external, or is in use or resident free")
        if (self._external - self._retired) - self._refs.keys() or self._external & self._resident_free.keys():
            raise InvariantError("an external page is neither in use nor retired, or is resident free")
        bad = [(p, m) for p, m in self.marks.items()
               if not 0 < m <= self.page_bytes or p not in self._refs or p in self._external]
        if bad:
            raise InvariantError(f"append marks outside (0, {self.page_bytes}] or of free pages: {bad[:8]}")
