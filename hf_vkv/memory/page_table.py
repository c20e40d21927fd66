"""Per-row page tables over a :class:`~hf_vkv.memory.pool.PagePool`. Pure bookkeeping.

A row holds ``length`` bytes in pages of ``page_size`` bytes: byte ``b`` lives in page index
``b // page_size``. Every translator counts bytes here, the paged one included (its pages are
blocks of ``page_size`` bytes); a :class:`~hf_vkv.memory.row_buffer.RowBuffer` converts its items
to bytes. Pages wholly behind a sliding window can be dropped from the front, so a row is
``(length, start, pages)`` with ``pages[k]`` holding page index ``start + k``.

Every feature of the cache is one of these operations; none of them moves bytes. The two that need
bytes moved or memory mapped say so in what they return (fresh pages to create, CoW copies to do),
and the caller (a :class:`~hf_vkv.memory.row_buffer.RowBuffer`) does it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from itertools import repeat
from types import MappingProxyType

from .errors import ArgumentError, CacheIndexError, CapacityError, InvariantError
from .pool import PageHints, PageId, PagePool
from .reorder_plan import grouped_plan, private_tails_plan, table_changes
from .table_records import EMPTY_ROW, CowCopy, Row

__all__ = ["Row", "PageTable", "CowCopy"]  # Row and CowCopy are table_records's (the reorder plan builds them too)


def _pages_for(length: int, page_size: int) -> int:
    return -(-length // page_size)


class PageTable:
    """Page tables for ``rows`` rows of at most ``pages_per_row`` pages each.

    Invariants (checked by :meth:`check_invariants`):

    * a row's table covers exactly its bytes: ``start + len(pages) == ceil(length / page_size)``
      and ``start <= ceil(length / page_size) <= pages_per_row``;
    * every page in a table is in use in the pool (no page is both free and referenced);
    * outside a transaction no row has a kept prefix (:meth:`kept_prefixes`: inside one, a row's
      kept slot bounds the pages that are still those at :meth:`begin`).

    That a page's refcount equals the number of entries holding it, over every table of the pool,
    is checked by :func:`~hf_vkv.memory.invariants.check_pages`, given all those tables.

    Operations are atomic: they validate and check the budget before changing anything. Inside a
    transaction (:meth:`begin`, mirrored on the pool by the caller) every replaced row is kept, so
    :meth:`rollback` restores the table exactly and :meth:`changed_rows` tells what to re-map.
    """

    def __init__(self, pool: PagePool, *, rows: int, pages_per_row: int, page_size: int,
                 hinted: bool = True) -> None:
        if rows <= 0 or pages_per_row <= 0 or page_size <= 0:
            raise ArgumentError(
                f"rows, pages_per_row and page_size must be positive, got {rows}, {pages_per_row}, {page_size}"
            )
        self.pool = pool
        self.rows = rows
        self.pages_per_row = pages_per_row
        self.page_size = page_size
        # Hinted tables ask for ids that keep a row's pages consecutive (so they merge into few
        # mappings); a paged block pool wants dense ids instead (its store grows to the highest id).
        self.hinted = hinted
        self._base = pool.add_segment(rows * pages_per_row)
        #: Each row's :class:`Row`, by index: read it freely (the buffers' views do, without a
        #: call per row); change it only through this table's operations.
        self.entries: list[Row] = [EMPTY_ROW] * rows
        self._undo: dict[int, Row] | None = None
        self._kept: dict[int, int] = {}  # changed rows whose pages below a slot are those at begin (kept_prefixes)
        self._undo_counters: tuple[int, int, int] = (0, 0, 0)
        self.cow_copies = 0  # pages copied by copy-on-write, over the table's life
        self.remapped_rows = 0  # rows that took another row's table in reorders
        self.tail_copies = 0  # partly written pages a reorder had copied into a row's own page

    # ----------------------------------------------------------------------------- transactions
    def begin(self) -> None:
        """Start keeping replaced rows (call together with ``pool.begin()``)."""
        if self._undo is not None:
            raise InvariantError("PageTable.begin() inside an open transaction")
        self._undo = {}
        self._kept = {}
        self._undo_counters = (self.cow_copies, self.remapped_rows, self.tail_copies)

    def commit(self) -> None:
        self._undo = None
        self._kept = {}

    def rollback(self) -> None:
        """Restore every row replaced since :meth:`begin`."""
        undo, self._undo, self._kept = self._undo or {}, None, {}
        for index, row in undo.items():
            self.entries[index] = row
        self.cow_copies, self.remapped_rows, self.tail_copies = self._undo_counters

    def changed_rows(self) -> dict[int, Row]:
        """Rows replaced in the open transaction, with their state at :meth:`begin`."""
        return dict(self._undo or {})

    def kept_prefixes(self) -> Mapping[int, int]:
        """Of the rows replaced in the open transaction, those whose every change kept their first
        pages (a grow, a copy-on-write of later pages): row -> the slot below which the row's
        start and pages are what they were at :meth:`begin`. What a buffer's mappings need not
        compare (a token-major row of 8k tokens holds 92k pages, and grows every step). A
        read-only view, valid until the transaction ends (no copy: a step of 64 head-major rows
        that crosses into new pages changes 11,520 sub-rows)."""
        return MappingProxyType(self._kept)

    def _set(self, index: int, row: Row, *, kept_below: int | None = None) -> None:
        """Replace row ``index``; ``kept_below``: its start and its pages below that slot stay
        (:meth:`kept_prefixes`)."""
        if self._undo is not None:
            first = index not in self._undo
            if first:
                self._undo[index] = self.entries[index]
            if kept_below is not None and (first or index in self._kept):
                self._kept[index] = kept_below if first else min(kept_below, self._kept[index])
            else:
                self._kept.pop(index, None)
        self.entries[index] = row

    # ----------------------------------------------------------------------------- queries
    def row(self, index: int) -> Row:
        """The table of row ``index``."""
        return self.entries[self._check_row(index)]

    def __iter__(self) -> Iterator[Row]:
        return iter(self.entries)

    def held_bytes(self) -> Iterator[tuple[PageId, int]]:
        """``(page, bytes of it the row holds)`` for every page of every row."""
        ps = self.page_size
        for row in self.entries:
            for index, page in enumerate(row.pages, row.start):
                yield page, min(ps, row.length - index * ps)

    def home(self, row: int, index: int) -> PageId:
        """The id a row's page index prefers, so a row's pages are consecutive physical ids."""
        return PageId(self._base + row * self.pages_per_row + index)

    def referenced_pages(self) -> Iterator[PageId]:
        """Every page of every row, once per table entry that holds it."""
        for row in self.entries:
            yield from row.pages

    def _check_row(self, index: int) -> int:
        if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < self.rows:
            raise CacheIndexError(f"row {index!r} is out of range: this table has rows 0..{self.rows - 1}")
        return index

    def _check_length(self, row: int, length: int) -> int:
        if length < 0:
            raise ArgumentError(f"length must be >= 0, got {length}")
        if _pages_for(length, self.page_size) > self.pages_per_row:
            raise CapacityError(
                f"row {row} would hold {length} bytes but its reservation holds "
                f"{self.pages_per_row * self.page_size}: create the cache with a larger max length"
            )
        return length

    # ----------------------------------------------------------------------------- operations
    def grow(self, row: int, length: int) -> list[PageId]:
        """Extend ``row`` to hold ``length`` bytes (no-op if it already does).

        Returns the pages the backend must create (fresh memory) before they are used.
        """
        return self.grow_and_cow([row], length, length)[1]

    def extend_in_place(self, rows: Sequence[int], start: int, end: int) -> bool:
        """Make each of ``rows`` hold at least ``end`` units if that needs no page table change but
        the lengths: every row already has the pages for ``[start, end)`` and none of those pages
        is shared. Then set the lengths of the rows shorter than ``end`` to ``end`` and return
        True (a row already longer, e.g. a static layout's mapped ahead, keeps its length: as
        :meth:`grow`); otherwise change nothing and return False
        (the caller grows and copies-on-write in a transaction, whose operations also reject a row
        out of range). The cheap path of a decode step that stays inside the rows' last pages (a
        head-major step calls it for every (layer, K/V, head) sub-row of every row).

        A shared page is written in place only by an append right after its append mark
        (:attr:`PagePool.marks`: one page, every row's length ``start``, one row per page); the
        mark advances to ``end``. A private page written loses its mark. Call it holding the lock
        of the pool's store (:meth:`RowBuffer.prepare_write` does): other threads' tables share
        the marks.

        Outside a transaction only (it keeps no undo). It runs for every group at every decode
        step: its cost per step is part of ``benchmarks/update_overhead.py``'s budget
        (``docs/benchmarks.md``, "Per-step overhead budget")."""
        if self._undo is not None:
            raise InvariantError("PageTable.extend_in_place() inside a transaction (it keeps no undo)")
        ps, n, entries, refs, marks = self.page_size, self.rows, self.entries, self.pool.refs, self.pool.marks
        need = _pages_for(end, ps)
        first, last = start // ps, (end - 1) // ps
        touched: list[PageId] = []  # the pages the write touches, of every row
        for row in rows:
            if not 0 <= row < n:
                return False
            length, s0, pages = entries[row]
            if s0 + len(pages) < need or start > length or first < s0:
                return False
            if first == last:  # one page (a decode step)
                touched.append(pages[first - s0])
            else:
                touched += pages[first - s0:last + 1 - s0]
        appended: list[PageId] = []  # shared pages written in place right after their marked bytes
        unmarked: list[PageId] = []  # private pages written whose marks go
        appendable = None  # whether a shared page may take an append in place (decided at the first one)
        for page in touched:
            if refs.get(page, 0) > 1:  # shared: the write needs copy-on-write ...
                if appendable is None:  # ... unless every row appends in one page, right after its length
                    appendable = bool(marks) and first == last and start % ps != 0 \
                        and all(entries[row].length == start for row in rows)
                if not appendable or marks.get(page) != start - first * ps:  # ... and the page's mark
                    return False
                appended.append(page)
            elif page in marks:
                unmarked.append(page)
        if appended:
            if len(set(appended)) != len(appended):  # two rows append to one page: the first only
                return False
            mark = min(ps, end - first * ps)
            for page in appended:
                marks[page] = mark
        for page in unmarked:
            del marks[page]
        for row in rows:  # each old record goes as its new one comes (none is kept alive meanwhile: a record
            # per sub-row alive at once set off the garbage collector several times a step)
            length, s0, pages = entries[row]
            if length < end:
                entries[row] = Row(end, s0, pages)
        return True

    def share(self, src: int, dst: int, *, length: int | None = None) -> None:
        """Make ``dst`` hold the first ``length`` bytes of ``src`` (all of it by default) by
        referencing the same pages; ``dst``'s previous pages are dropped. Zero bytes move; a
        partly filled last page stays shared until someone writes to it (see :meth:`cow`)."""
        self.share_rows([(src, dst)], length=length)

    def share_rows(self, pairs: Iterable[tuple[int, int]], *, length: int | None = None) -> None:
        """:meth:`share` of each ``(src, dst)`` pair (each ``dst`` once), in one reference change
        (:meth:`assign_rows`): every source's table is read, and every pair checked, before any
        row changes. What sharing a prompt's rows of many parts with its repeats does (one call
        for all parts and all followers, where :meth:`share` of each part made one each)."""
        self.assign_rows([(dst, self._prefix_of(src, length)) for src, dst in pairs])

    def _prefix_of(self, src: int, length: int | None) -> Row:
        """The table holding the first ``length`` bytes of row ``src`` (all of it for ``None``)."""
        source = self.entries[self._check_row(src)]
        length = source.length if length is None else length
        if not 0 <= length <= source.length:
            raise ArgumentError(f"length {length} is outside row {src}'s 0..{source.length} bytes")
        end = _pages_for(length, self.page_size)
        if length and end <= source.start:
            raise ArgumentError(f"row {src}'s first {length} bytes were dropped behind its window")
        return Row(length, source.start, source.pages[: end - source.start]) if length else EMPTY_ROW

    def assign(self, row: int, table: Row) -> None:
        """Make ``row`` hold ``table`` (pages of this pool, e.g. another table's row: a fork),
        adding a reference to each of its pages and dropping the row's previous pages."""
        self.assign_rows([(row, table)])

    def assign_rows(self, tables: Iterable[tuple[int, Row]]) -> None:
        """:meth:`assign` of each ``(row, table)`` (each row once), in one reference change for
        all of them: every table is checked before anything changes, then each page of the new
        tables gains a reference before the rows' previous pages lose theirs (so a page may move
        from one of the rows to another). What a fork, an adopt or an install of rows of many
        parts does: one pool call for all their parts (a SmolLM2 row has 180, one per layer, K/V
        and head), where :meth:`assign` of each part made one each."""
        todo: list[tuple[int, Row]] = []
        new: list[PageId] = []
        old: list[PageId] = []
        seen: set[int] = set()
        for row, table in tables:
            current = self.entries[self._check_row(row)]
            if row in seen:
                raise ArgumentError(f"row {row} is given twice")
            seen.add(row)
            if table == current:
                continue
            need = _pages_for(table.length, self.page_size)
            if table.end != need or table.start > need:
                raise ArgumentError(f"row table {table} does not cover its length")
            self._check_length(row, table.length)
            todo.append((row, table))
            new.extend(table.pages)
            old.extend(current.pages)
        refs = self.pool.refs
        if 0 in map(refs.get, new, repeat(0)):  # (in C when all are in use) named, as a bad argument, before anything changes
            free = [p for p in new if refs.get(p, 0) < 1]
            raise ArgumentError(f"row tables hold pages {free[:4]} that are not in use in this pool")
        self.pool.incref(new)
        self.pool.decref(old)
        for row, table in todo:
            self._set(row, table)

    def reorder(self, index: Sequence[int | None], *, private_tails: bool = False, remaps_cost: bool = False,
                gathered: bool = False, written: int | None = None,
                groups: Sequence[Sequence[int]] | None = None) -> list[CowCopy]:
        """Row ``i`` takes row ``index[i]``'s table (duplicates allowed, as in beam search); a
        ``None`` entry, and every row from ``len(index)`` on, becomes empty. Only references move.

        A row's new table is compared with its old one: a row whose table does not change (a beam
        that keeps its own history) is not touched, and references move only for the pages past
        the two tables' common prefix, so the work follows what changed, not the rows' lengths.

        ``private_tails``: a row that takes another row's table keeps its own pages at the
        indices of the taken table's tail (from the page holding the first unwritten byte on:
        ``written`` bytes, default the row's length; a static layout maps pages ahead of its
        writes) where no row holds them afterwards and either the taken page would be shared
        (the next write would copy it on write anyway) or, with ``remaps_cost`` (a translator
        that remaps a changed page), only the tail differs or the page holds no written byte
        (keeping it copies nothing, and frees the page a row before it in a chain needs). The
        returned :class:`CowCopy` list says what the caller must copy (``src``, the taken page, into ``dst``, the row's own page,
        its written bytes; after it the row reads as if it had taken ``src``), in the order they
        must run: a page may be copied from and later into, never the reverse, so running them in
        order or all reads before any write is right.
        ``gathered`` (the caller reads every source before writing any destination): rows that
        take each other's tails (a swap, a cycle) copy in place too. Without ``private_tails``
        nothing is returned.
        ``groups`` (every row once): rows that always hold the same items, as a row buffer's parts
        do; the plan is then made once per group and applied to its rows
        (:func:`~hf_vkv.memory.reorder_plan.grouped_plan`), or per row where they differ."""
        rows = self.rows
        index = [i if i is None or (type(i) is int and 0 <= i < rows) else self._check_row(int(i)) for i in index]
        if len(index) > rows:
            raise ArgumentError(f"index has {len(index)} entries but the table has {rows} rows")
        plan = grouped_plan(self.entries, index, groups, self.pool.refs, self.page_size, private_tails=private_tails,
                            remaps_cost=remaps_cost, gathered=gathered, written=written) \
            if groups is not None and len(groups) < rows else None
        if plan is not None:
            changes, delta, copies = plan
        else:
            changes, delta = table_changes(self.entries, index)
            copies = private_tails_plan(changes, delta, self.entries, self.pool.refs, self.page_size,
                                        remaps_cost=remaps_cost, gathered=gathered, written=written) \
                if private_tails and changes else []
        self.pool.adjust(delta)
        for change in changes:
            if change is not None:
                i, after, _ = change
                self._set(i, after)
                self.remapped_rows += i < len(index) and index[i] is not None and index[i] != i
        if copies and self.pool.marks:  # their bytes are rewritten: whatever a mark said of them goes
            self.pool.drop_marks([copy.dst for copy in copies])
        self.tail_copies += len(copies)
        return copies

    def grow_and_cow(self, rows: Sequence[int], start: int, end: int
                     ) -> tuple[list[CowCopy], list[PageId], list[int]]:
        """:meth:`grow` each of ``rows`` to (at least) ``end`` bytes, then :meth:`cow` its bytes
        ``[start, end)``: the same checks, pages, hints and order as those calls row by row, with
        one allocation for all of them (a write that leaves the rows' last pages: every (layer,
        K/V, head) sub-row of a head-major row at once). Everything is checked before anything
        changes.

        A shared page is not copied when a row appends right after its append mark
        (:attr:`PagePool.marks`: ``start`` is the row's length, inside the page); the first such
        row writes in place and the mark advances, so a second one copies. A row that keeps a
        marked last page and grows advances its mark.

        Returns ``(copies, created, nbytes)``: the copies the caller must perform (in order), the
        pages the backend must create first, and each copy's bytes (what its row had written in
        the source page before the grow: ``min(page, length - index * page)``, at least 0)."""
        ps, home, hinted, refs, marks = self.page_size, self.home, self.hinted, self.pool.refs, self.pool.marks
        dropping: dict[PageId, int] = {}  # references the copies planned so far will drop
        moved: dict[PageId, int] = {}  # append marks the rows planned so far advance
        # per row, in parallel lists (no record per row: a decode step of 64 head-major rows that leaves
        # their last pages plans 11,520 sub-rows): the row, its table, its length after, the pages it
        # grows by, the indices of the shared pages it copies
        plan_rows: list[int] = []
        plan_olds: list[Row] = []
        plan_lengths: list[int] = []
        plan_grown: list[int] = []
        plan_shared: list[Sequence[int]] = []
        hints = PageHints()
        prefer, home_of = hints.first, hints.second
        for row in rows:
            old = self.entries[self._check_row(row)]
            self._check_length(row, end)
            length = end if end > old.length else old.length
            if start < 0 or start > end:
                raise ArgumentError(f"write range [{start}, {end}) is outside row {row}'s 0..{length} bytes")
            need = _pages_for(length, ps)
            last = old.pages[-1] if old.pages else None
            grown = need - old.end
            if hinted:  # a row's pages prefer consecutive ids: after its last page, else its home
                prefer.extend(range(last + 1, last + 1 + grown) if last is not None else repeat(-1, grown))
                at = home(row, old.end)
                home_of.extend(range(at, at + grown))
            else:
                prefer.extend(repeat(-1, grown))
                home_of.extend(repeat(-1, grown))
            first, final = start // ps, (end - 1) // ps
            if start < end and first < old.start:
                raise ArgumentError(f"row {row} cannot write byte {start}: it was dropped behind the window")
            shared: list[int] | tuple[()] = ()  # as the calls row by row see it: a copy drops its source's
            # reference before the next row (a list only where there is one: a row of none makes no object)
            for i in range(first, min(final + 1, old.end)) if start < end else ():
                page = old.pages[i - old.start]
                if refs.get(page, 0) - dropping.get(page, 0) > 1:
                    if i == first and start == old.length and start % ps and \
                            moved.get(page, marks.get(page)) == start - i * ps:
                        continue  # an append right after the page's marked bytes: in place (the mark advances)
                    if shared:
                        shared.append(i)  # type: ignore[union-attr]
                    else:
                        shared = [i]
                    dropping[page] = dropping.get(page, 0) + 1
            if old.pages and (marks or moved) and (not shared or shared[-1] != old.end - 1):
                tail = old.pages[-1]  # the row keeps its last page: its mark covers the row's bytes there
                mark, held = moved.get(tail, marks.get(tail)), min(ps, length - (old.end - 1) * ps)
                if mark is not None and held > mark:
                    moved[tail] = held
            for i in shared:
                prefer.append(old.pages[i - 1 - old.start] + 1 if hinted and i > old.start else -1)
                home_of.append(home(row, i) if hinted else -1)
            plan_rows.append(row)
            plan_olds.append(old)
            plan_lengths.append(length)
            plan_grown.append(grown)
            plan_shared.append(shared)
        pages, created = self.pool.allocate(hints)
        copies: list[CowCopy] = []
        nbytes: list[int] = []
        sources: list[PageId] = []
        taken = 0
        for row, old, length, grown, shared in zip(plan_rows, plan_olds, plan_lengths, plan_grown, plan_shared):
            table = old.pages + tuple(pages[taken:taken + grown]) if grown else old.pages  # one copy of the row's
            # pages (a token-major row of 8k tokens holds 92k: three copies a step were 0.7 ms a row)
            taken += grown
            if shared:
                edited = list(table)
                for i, page in zip(shared, pages[taken:taken + len(shared)]):
                    copies.append(CowCopy(row, i, edited[i - old.start], page))
                    nbytes.append(max(0, min(ps, old.length - i * ps)))
                    sources.append(edited[i - old.start])
                    edited[i - old.start] = page
                table = tuple(edited)
                taken += len(shared)
            if grown or shared or length != old.length:
                self._set(row, Row(length, old.start, table), kept_below=shared[0] if shared else old.end)
        self.pool.decref(sources)
        self.pool.set_marks(moved)
        self.cow_copies += len(copies)
        return copies, created, nbytes

    def cow(self, row: int, start: int, end: int) -> tuple[list[CowCopy], list[PageId]]:
        """Give ``row`` private copies of the shared pages that bytes ``[start, end)`` touch.

        Call before writing those bytes. Returns the copies the caller must perform, and the
        destination pages the backend must create first.
        """
        old = self.entries[self._check_row(row)]
        if not 0 <= start <= end <= old.length:
            raise ArgumentError(f"write range [{start}, {end}) is outside row {row}'s 0..{old.length} bytes")
        copies, created, _ = self.grow_and_cow([row], start, end)
        return copies, created

    def truncate(self, row: int, length: int) -> None:
        """Shrink ``row`` to ``length`` bytes, dropping pages past the end."""
        old = self.entries[self._check_row(row)]
        if not 0 <= length <= old.length:
            raise ArgumentError(f"cannot truncate row {row} from {old.length} to {length} bytes")
        if length == old.length:
            return
        end = _pages_for(length, self.page_size)
        keep = max(end - old.start, 0)
        self.pool.decref(old.pages[keep:])
        self._set(row, Row(length, min(old.start, end), old.pages[:keep]) if length else EMPTY_ROW)

    def drop_before(self, row: int, offset: int) -> None:
        """Drop the pages of ``row`` that lie wholly before byte ``offset`` (behind a sliding window)."""
        old = self.entries[self._check_row(row)]
        if not 0 <= offset <= old.length:
            raise ArgumentError(f"byte {offset} is outside row {row}'s 0..{old.length} bytes")
        new_start = min(offset // self.page_size, old.end)
        if new_start <= old.start:
            return
        cut = new_start - old.start
        self.pool.decref(old.pages[:cut])
        self._set(row, Row(old.length, new_start, old.pages[cut:]))

    def clear(self, row: int) -> None:
        """Empty ``row``, dropping all its pages."""
        self.clear_rows((row,))

    def clear_rows(self, rows: Iterable[int]) -> None:
        """Empty each of ``rows``, dropping all their pages. Rows that share a prompt hold its
        pages many times over (64 rows of a 2k-token prompt: 1.5 million references to 5,760
        pages): where a row's first page is shared, the references are counted first (in C) and a
        page held several times loses them in one :meth:`PagePool.adjust`; other pages go through
        :meth:`PagePool.decref` (cheaper for pages held once)."""
        rows = [self._check_row(r) for r in rows]
        held = [r for r in rows if self.entries[r].length or self.entries[r].pages]
        refs = self.pool.refs
        if any(refs.get(self.entries[r].pages[0], 0) > 1 for r in held if self.entries[r].pages):
            drop: Counter[PageId] = Counter()
            for r in held:
                drop.update(self.entries[r].pages)
            self.pool.adjust({page: -count for page, count in drop.items() if count > 1})
            self.pool.decref([page for page, count in drop.items() if count == 1])
        else:
            self.pool.decref([page for r in held for page in self.entries[r].pages])
        for r in held:
            self._set(r, EMPTY_ROW)

    # ----------------------------------------------------------------------------- checks
    def shared_pages(self) -> int:
        """Distinct pages of this table held by more than one table entry (anywhere in the pool)."""
        return sum(1 for p in {p for r in self.entries for p in r.pages} if self.pool.is_shared(p))

    def check_invariants(self) -> None:
        """Raise :class:`InvariantError` unless the table's invariants (class docstring) hold."""
        if self._undo is not None:
            raise InvariantError("check_invariants() inside an open transaction")
        if self._kept:
            raise InvariantError(f"rows {sorted(self._kept)[:4]} keep a transaction's kept prefixes after it ended")
        for i, row in enumerate(self.entries):
            need = _pages_for(row.length, self.page_size)
            if row.end != need or row.start > need or need > self.pages_per_row:
                raise InvariantError(
                    f"row {i}: length {row.length} needs pages up to {need}, table covers "
                    f"[{row.start}, {row.end}) of at most {self.pages_per_row}"
                )
            for page in row.pages:
                if self.pool.refcount(page) < 1:
                    raise InvariantError(f"row {i} holds page {page}, which the pool says is free")
