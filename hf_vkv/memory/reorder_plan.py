"""The plan of a beam reorder over page tables: which rows change, how references move, and which
partly written pages are copied into a row's own page. Pure bookkeeping over :class:`Row` records
and a pool's refcounts (no tensor, no backend); :meth:`PageTable.reorder` applies it.

A reorder follows what changed, not the rows' lengths: beams share their prompt's pages and
differ in their last page or few, so each row's new table is compared with its old one from the
front (:func:`common_prefix`, slice comparisons, no Python loop over the shared pages), and only
the pages past the common prefix move references.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from functools import partial
from itertools import chain, repeat
from operator import add, itemgetter

from .pool import PageId
from .table_records import EMPTY_ROW, CowCopy, Row

__all__ = ["Change", "common_prefix", "grouped_plan", "private_tails_plan", "table_changes"]

#: A row whose table changes: ``(row, its new table, pages its old and new tables have in common
#: from the front)``.
Change = tuple[int, Row, int]

_NEW_ROW = partial(tuple.__new__, Row)  # Row(*fields), called from C (grouped_plan's rows that keep one run)


def _copy(fields: tuple[int, int, PageId, PageId]) -> CowCopy:
    """``CowCopy(*fields)`` without the named tuple's Python-level ``__new__`` (one per sub-row of a beam)."""
    return tuple.__new__(CowCopy, fields)


def common_prefix(a: Sequence[object], b: Sequence[object], guess: int | None = None) -> int:
    """How many leading entries ``a`` and ``b`` have in common. ``guess`` is where the answer
    probably lies (beams differ in their last page: ``min(len(a), len(b)) - 1``): one slice
    comparison confirms it, and a bisection of slice comparisons finds the answer otherwise, so
    no Python loop walks the common pages."""
    n = min(len(a), len(b))
    lo, hi = 0, n  # a[:lo] == b[:lo], and the answer is in [lo, hi]
    if guess is not None and 0 < guess <= n:
        if a[:guess] == b[:guess]:
            lo = guess
        else:
            hi = guess - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def table_changes(entries: Sequence[Row], index: Sequence[int | None]) -> tuple[list[Change | None], dict[PageId, int]]:
    """Row ``i`` takes ``entries[index[i]]`` (``None``, and rows past ``index``: empty; the
    indices are valid): the rows whose table changes, and the net reference change per page
    (``+1`` for each page a row takes past the common prefix, ``-1`` for each it drops)."""
    changes: list[Change | None] = []
    taken: list[tuple[PageId, ...]] = []  # page runs that gain a reference (one per changed row)
    dropped: list[tuple[PageId, ...]] = []  # page runs that lose one
    for i in range(len(entries)):
        src = index[i] if i < len(index) else None
        before = entries[i]
        after = EMPTY_ROW if src is None else entries[src]
        if after is before:
            continue
        bp, ap = before.pages, after.pages
        if before.start == after.start:
            m = len(bp) if len(bp) < len(ap) else len(ap)
            if m and bp[:m - 1] == ap[:m - 1]:  # inline: the beams' case, all in common but the last page
                k = m if bp[m - 1] == ap[m - 1] else m - 1
            else:
                k = common_prefix(bp, ap)
            if k == len(bp) == len(ap) and before.length == after.length:
                continue  # the same table
        else:
            k = 0
        taken.append(ap[k:])  # (the very tuple where k = 0: a repeat's rows count it once, _occurrences)
        dropped.append(bp[k:])
        changes.append((i, after, k))
    return changes, _net_references(taken, dropped)


def private_tails_plan(changes: list[Change | None], delta: dict[PageId, int], entries: Sequence[Row],
                   refs: Mapping[PageId, int], page_size: int, *, remaps_cost: bool, gathered: bool,
                   written: int | None) -> list[CowCopy]:
    """The tail copies of a reorder with ``private_tails`` (:meth:`PageTable.reorder`): update
    ``changes`` and
    ``delta`` in place (a change becomes ``None`` where the row's table ends as it was: only
    bytes move), return the copies in the order they must run.

    A row's tail is its pages from the one holding its first unwritten byte on (``written``
    bytes, or its length). At each tail index a row keeps its own page ``mine`` when no row
    holds ``mine`` afterwards; the taken page's written bytes are copied into it (none for
    a page past the written bytes). Passes repeat until none applies, since a row that keeps
    its page may free the page another row needs: then ``mine`` is also the source of an
    earlier copy, which is why the copies run in order. Never the reverse: a page copied
    into was held by nobody when it was chosen, so no later copy reads it (a later source is
    a page its row holds). With ``remaps_cost``, a row that took a page nobody else holds
    (no copy) becomes a candidate too once an earlier row of a chain waits for that page: it
    keeps its own instead, which frees the page for the row waiting (a copy for a remap and a
    later copy-on-write).

    With ``gathered``, the rows left over (each one's page held by another of them: rows
    that take each other's tails) all keep their pages at once, when nobody else holds them."""
    ps = page_size
    copies: list[CowCopy] = []
    pending: dict[tuple[int, int], tuple[PageId, PageId, int]] = {}  # (change, index) -> (mine, theirs, bytes)
    kept: dict[int, dict[int, PageId]] = {}  # change -> {index: the row's own page it keeps}
    outright: dict[PageId, tuple[int, int, PageId, int]] = {}  # page taken unshared -> (change, index, mine, bytes)
    for n, (i, after, k) in enumerate(changes):  # type: ignore[misc]
        # (Row.end spelled out, and no min/max calls: this runs for every sub-row of every beam)
        before, a0, ap = entries[i], after.start, after.pages
        b0, bp, length = before.start, before.pages, after.length
        w = length if written is None or written > length else written
        tail = w // ps if w // ps > a0 else a0  # the first tail index
        a_end, b_end = a0 + len(ap), b0 + len(bp)
        if tail >= a_end or not (w % ps or w < length):
            continue  # every page full of written bytes: the next write takes a new one
        only_tail = k >= tail - a0  # every page before the tail is the same
        lo = tail if tail > b0 else b0
        lo = lo if lo > a0 + k else a0 + k
        hi = a_end if a_end < b_end else b_end
        # the beams' case: one tail page, all else the same: keeping it leaves the table as it was
        whole = only_tail and hi - lo == 1 == a_end - tail and a0 == b0 and a_end == b_end and length == before.length
        for j in range(lo, hi):
            mine, theirs = bp[j - b0], ap[j - a0]
            nbytes = w - j * ps if w - j * ps < ps else ps
            if mine == theirs:
                continue
            # with remaps_cost, a page past the written bytes is kept too: no copy and no remap (and a
            # row that keeps it frees the page an earlier row of a chain needs: a static layout's pages)
            if not (refs[theirs] + delta[theirs] > 1 or (remaps_cost and (only_tail or nbytes <= 0))):
                if remaps_cost:
                    outright[theirs] = (n, j, mine, nbytes)  # taken, not copied: unless a chain needs it
                continue
            if refs[mine] + delta[mine]:
                pending[n, j] = (mine, theirs, nbytes if nbytes > 0 else 0)  # held: maybe not after others' turns
                continue
            delta[mine] += 1  # nobody holds it: kept at once (inline: this runs for every sub-row of a beam)
            delta[theirs] -= 1
            if whole:
                changes[n] = None
            elif n in kept:
                kept[n][j] = mine
            else:
                kept[n] = {j: mine}
            if nbytes > 0:
                copies.append(_copy((i, j, theirs, mine)))

    def keep(key: tuple[int, int]) -> None:
        mine, theirs, nbytes = pending.pop(key)
        delta[mine] += 1
        delta[theirs] -= 1
        kept.setdefault(key[0], {})[key[1]] = mine
        if nbytes:
            copies.append(_copy((changes[key[0]][0], key[1], theirs, mine)))  # type: ignore[index]

    again = True
    while again:  # pages nobody holds (any more), one at a time: keeping one may free another
        again = False
        for key in list(pending):
            mine = pending[key][0]
            if not refs[mine] + delta[mine]:
                keep(key)
                again = True
            elif mine in outright:  # a row took `mine` outright: it may keep its own page instead
                n2, j2, own, nbytes = outright.pop(mine)
                pending[n2, j2] = (own, mine, nbytes if nbytes > 0 else 0)
                again = True
    if gathered and pending:
        cycle = dict(pending)
        while True:  # drop pages someone outside the cycle holds (or another row keeps)
            held: dict[PageId, int] = {}
            for _, theirs, _ in cycle.values():
                held[theirs] = held.get(theirs, 0) + 1
            seen: set[PageId] = set()
            out = []
            for key, (mine, _, _) in cycle.items():
                if mine in seen or refs[mine] + delta[mine] > held.get(mine, 0):
                    out.append(key)
                seen.add(mine)
            if not out:
                break
            for key in out:
                del cycle[key]
        for key in cycle:
            keep(key)
    for n, pages in kept.items():
        i, after, k = changes[n]  # type: ignore[misc]
        before, lo = entries[i], min(pages)
        rel = lo - after.start
        if k >= rel and len(pages) == after.end - lo and after.start == before.start \
                and after.length == before.length and len(after.pages) == len(before.pages):
            changes[n] = None  # the pages before the tail were the same, the tail's are its own again
        else:
            new = after.pages[:rel] + tuple(pages.get(j, p) for j, p in enumerate(after.pages[rel:], lo))
            changes[n] = (i, Row(after.length, after.start, new), k)
    return copies


def grouped_plan(entries: Sequence[Row], index: Sequence[int | None], groups: Sequence[Sequence[int]],
                 refs: Mapping[PageId, int], page_size: int, *, private_tails: bool, remaps_cost: bool,
                 gathered: bool, written: int | None
                 ) -> tuple[Iterable[Change], dict[PageId, int], list[CowCopy]] | None:
    """The plan of :meth:`PageTable.reorder` (changes, to be read once; net reference change per
    page; tail copies in order) for table rows in ``groups`` that always hold the same items: a
    row buffer's rows and their parts (the head-major layout's ``2 x layers x heads`` sub-rows of
    a row), whose tables have the same shape and share pages with the same parts of other rows in
    the same places (:meth:`~hf_vkv.memory.row_buffer.RowBuffer.check_shared_parts`).

    The plan is made once per group, on its first row (:func:`table_changes`,
    :func:`private_tails_plan`), and applied to every row of the group with what it decided: the
    common prefix ``k``, the tail indices where the row keeps its own page, the copies; the
    references then move for each row's own pages, counted in C (no Python loop per page or per
    copy). Each row is checked first: ``index`` maps it to the same part of its source, its old
    and new tables have its first row's lengths and starts, and the same page just before ``k``;
    every page a copy writes into is afterwards held by its row alone and written once. If a check
    fails this returns ``None`` and the caller plans per table row. ``index`` is over table rows
    (a row past it, or ``None``, becomes empty); ``groups`` covers every table row, once."""
    n_index = len(index)
    first_of = {g[0]: k for k, g in enumerate(groups)}
    heads = [entries[g[0]] for g in groups]
    head_index: list[int | None] = []
    for g in groups:
        src = index[g[0]] if g[0] < n_index else None
        head_index.append(None if src is None else first_of.get(src, -1))
        if head_index[-1] == -1:
            return None  # a group's first row takes a row that is not a group's first
    planned, head_delta = table_changes(heads, head_index)
    decided = list(planned)
    head_copies = private_tails_plan(decided, head_delta, heads, refs, page_size, remaps_cost=remaps_cost,
                                     gathered=gathered, written=written) if private_tails and planned else []
    copies_of: dict[int, list[int]] = {}  # group -> the tail indices its first row copies into
    for c in head_copies:
        copies_of.setdefault(c.row, []).append(c.index)
    changes: list[Iterable[Change]] = []  # each group's, made as they are read (a tuple per row set off the
    # cyclic garbage collector: a repeat into 64 rows changes 11,520 sub-rows)
    taken: list[tuple[PageId, ...]] = []  # page runs that gain a reference (one per row)
    dropped: list[tuple[PageId, ...]] = []  # page runs that lose one
    expanded: dict[tuple[int, int], tuple[list[CowCopy], list[PageId], list[PageId]]] = {}  # (group, tail
    # index) -> its rows' copies, their source pages and their destination pages
    whole_index = n_index == len(entries)  # (C lookups below instead of a comprehension per sub-row)
    for (g, after0, k), decision in zip(planned, decided):  # type: ignore[misc]
        before0, src_group = heads[g], head_index[g]
        targets = groups[g]
        sources = groups[src_group] if src_group is not None else None
        if sources is None:
            sources, olds, news = (None,) * len(targets), [entries[t] for t in targets], [EMPTY_ROW] * len(targets)
        else:
            if len(sources) != len(targets):
                return None
            olds, news = list(map(entries.__getitem__, targets)), list(map(entries.__getitem__, sources))
        took = list(map(index.__getitem__, targets)) if whole_index else \
            [index[t] if t < n_index else None for t in targets]
        if took != list(sources) \
                or set(map(_SHAPE, olds)) != {_SHAPE(before0)} or set(map(_SHAPE, news)) != {_SHAPE(after0)}:
            return None  # (length, start) fix a table's page count: the same shape as the first row's
        bps, aps = list(map(_PAGES, olds)), list(map(_PAGES, news))
        if k and list(map(itemgetter(k - 1), bps)) != list(map(itemgetter(k - 1), aps)):
            return None
        a0, b0 = after0.start, before0.start
        for j in copies_of.get(g, ()):  # the row's own page at index j takes the source's bytes
            srcs, dsts = list(map(itemgetter(j - a0), aps)), list(map(itemgetter(j - b0), bps))
            expanded[g, j] = (list(map(_NEW_COPY, zip(targets, repeat(j), srcs, dsts))), srcs, dsts)
        if decision is None:
            continue  # the row's table ends as it was: only bytes move
        final0 = decision[1]
        kept = [j for j in range(k, len(after0.pages)) if final0.pages[j] != after0.pages[j]] \
            if final0 is not after0 else []  # relative to after0.start: where the row keeps its own page
        if kept and kept[-1] - kept[0] == len(kept) - 1:  # one run of its own pages (the tail and after): in C
            f, e, off = kept[0], kept[-1] + 1, a0 - b0
            pages = map(add, map(add, map(itemgetter(slice(f)), aps), map(itemgetter(slice(f + off, e + off)), bps)),
                        map(itemgetter(slice(e, None)), aps))
            news = list(map(_NEW_ROW, zip(repeat(after0.length), repeat(a0), pages)))
        elif kept:
            rows = []
            for bp, ap, after in zip(bps, aps, news):
                pages = list(ap)
                for j in kept:
                    pages[j] = bp[j + a0 - b0]
                rows.append(Row(after.length, a0, tuple(pages)))
            news = rows
        cut = itemgetter(slice(k, None))
        taken.extend(map(cut, map(_PAGES, news)))
        dropped.extend(map(cut, bps))
        changes.append(zip(targets, news, repeat(k)))
    delta = _net_references(taken, dropped)
    get = delta.get
    copies = []
    written_into: set[PageId] = set()
    for c in head_copies:
        batch, srcs, dsts = expanded[c.row, c.index]
        # held by their rows alone before, and no reference moves for them: by their rows alone after
        # (stricter than refs + delta == 1, in two C passes; a page it refuses is planned per row)
        if max(map(refs.get, dsts, repeat(0))) != 1 or any(map(get, dsts)) \
                or len(set(dsts)) != len(dsts) or not written_into.isdisjoint(dsts) \
                or not (gathered or (written_into.isdisjoint(srcs) and set(dsts).isdisjoint(srcs))):
            return None  # a page copied into that another row holds, or reads after it is written
        written_into.update(dsts)
        copies += batch
    return chain.from_iterable(changes), delta, copies


def _net_references(taken: list[tuple[PageId, ...]], dropped: list[tuple[PageId, ...]]) -> dict[PageId, int]:
    """The net reference change per page: ``+1`` for each occurrence in ``taken``, ``-1`` in ``dropped``."""
    delta = _occurrences(taken)
    get = delta.get
    for page, n in _occurrences(dropped).items():
        delta[page] = get(page, 0) - n
    return dict(delta)


def _occurrences(runs: list[tuple[PageId, ...]]) -> Counter[PageId]:
    """How often each page occurs in ``runs``, counting the pages of a tuple that occurs ``m``
    times once and then ``m`` times over (rows that repeat a row take its very tuples: a repeat of
    one head-major row into 64 would otherwise count 63 x 180 x its pages one by one)."""
    times = Counter(map(id, runs))
    if len(times) == len(runs):
        return Counter(chain.from_iterable(runs))
    by_times: dict[int, dict[int, tuple[PageId, ...]]] = {}
    for run in runs:
        by_times.setdefault(times[id(run)], {})[id(run)] = run
    total: Counter[PageId] = Counter()
    for m, distinct in by_times.items():
        once = Counter(chain.from_iterable(distinct.values()))
        total.update(once if m == 1 else dict(zip(once, map(m.__mul__, once.values()))))
    return total


_SHAPE = itemgetter(0, 1)  # a Row's (length, start)
_PAGES = itemgetter(2)  # a Row's pages
_NEW_COPY = partial(tuple.__new__, CowCopy)  # CowCopy(*fields), called from C
