"""Executable specs of PageTable: exact Row records, page ids, refcounts and CoW copies.

Tiny tables: pages of 4 bytes, 4 pages a row, so row ``r``'s page index ``i`` prefers the id
``4 * r + i`` (its home). After every operation :func:`check_pages` checks the pool, the tables
and that every refcount equals the entries holding the page (over all tables of the pool).
"""

from __future__ import annotations

import pytest

from hf_vkv.memory import (
    CapacityError,
    CowCopy,
    InvariantError,
    KVCacheOutOfMemory,
    PageId,
    PagePool,
    PageTable,
    Row,
    check_pages,
)
from hf_vkv.memory.reorder_plan import _occurrences, common_prefix, grouped_plan

P = PageId


def make(rows: int = 4, budget: int = 64) -> PageTable:
    pool = PagePool(page_bytes=4096, budget_pages=budget)
    return PageTable(pool, rows=rows, pages_per_row=4, page_size=4)


def ok(table: PageTable, *others: PageTable) -> PageTable:
    """Check ``table`` and the ``others`` of its pool (every table the pool has); return ``table``."""
    check_pages(table.pool, [table, *others])
    return table


def refs(table: PageTable, *pages: int) -> list[int]:
    return [table.pool.refcount(P(p)) for p in pages]


def state(*tables: PageTable) -> tuple:
    pool = tables[0].pool
    return ([tuple(t) for t in tables], [(t.cow_copies, t.remapped_rows) for t in tables], pool.stats(),
            pool.in_use_pages(), pool.resident_free_pages(), {p: pool.refcount(p) for p in pool.in_use_pages()})


# ------------------------------------------------------------------------------------ grow / free
def test_grow_appends_home_pages_and_reports_what_to_create():
    t = make()
    assert t.grow(0, 5) == [0, 1]
    assert ok(t).row(0) == Row(length=5, start=0, pages=(P(0), P(1)))
    assert t.grow(0, 8) == [] and t.row(0) == Row(8, 0, (0, 1))  # same pages, longer
    assert t.grow(0, 3) == [] and t.row(0).length == 8  # never shrinks
    assert t.grow(2, 9) == [8, 9, 10]
    assert ok(t).row(2) == Row(9, 0, (8, 9, 10))
    assert refs(t, 0, 1, 8, 9, 10, 2) == [1, 1, 1, 1, 1, 0]
    assert list(t) == [Row(8, 0, (0, 1)), Row(), Row(9, 0, (8, 9, 10)), Row()]


def test_clear_frees_pages_and_a_regrown_row_recycles_them():
    t = make()
    t.grow(1, 8)
    t.clear(1)
    assert ok(t).row(1) == Row() and t.pool.resident_free_pages() == {4, 5}
    assert t.grow(1, 5) == []  # home ids 4, 5 are resident: nothing to create
    assert ok(t).row(1) == Row(5, 0, (4, 5))
    assert t.pool.stats().recycled == 2 and t.pool.stats().created == 2
    t.clear(3)  # an empty row: nothing happens
    assert ok(t).row(3) == Row()


def test_clear_rows_drops_shared_and_own_pages_at_once_and_refuses_a_bad_row_first():
    """Rows that share pages (a prompt repeated) and rows with pages of their own, emptied in one
    call: every reference goes, a page held by a row left alone keeps its count, and a row out of
    range changes nothing."""
    t = make(rows=5)
    t.grow(0, 9)  # pages 0, 1, 2
    for r in (1, 2, 3):
        t.share(0, r)
    t.grow(3, 13)  # row 3 writes its own last page after the shared ones: 3's fourth page
    t.grow(4, 5)  # pages of its own: 16, 17
    before = state(ok(t))
    with pytest.raises(IndexError):
        t.clear_rows([0, 5])
    assert state(t) == before
    t.clear_rows([0, 1, 3, 4])
    assert ok(t).row(2) == Row(9, 0, (0, 1, 2)) and [t.row(r) for r in (0, 1, 3, 4)] == [Row()] * 4
    assert refs(t, 0, 1, 2) == [1, 1, 1]  # row 2's alone now
    t.clear_rows(range(5))
    assert ok(t).pool.stats().in_use == 0 and list(t) == [Row()] * 5
    t.clear_rows(range(5))  # empty rows: nothing happens
    assert ok(t).pool.stats().in_use == 0


def test_free_then_reuse_recycles_resident_pages_before_touching_fresh_ones():
    t = make()
    t.grow(0, 8)  # pages 0, 1
    t.reorder([0, 0])  # row 1 shares row 0's pages, so row 0 can not grow onto ids 2 or 3 ...
    t.grow(1, 12)  # ... once row 1 took page 2 (right after its last page 1)
    assert ok(t).row(1) == Row(12, 0, (0, 1, 2))
    t.grow(3, 4)
    t.clear(3)  # page 12 is resident and free
    # Row 0's hints are 2 (after its last page: in use) and its home 2 (in use): recycle 12.
    assert t.grow(0, 12) == []
    assert ok(t).row(0) == Row(12, 0, (0, 1, 12))


def test_grow_after_a_recycled_page_follows_it_with_consecutive_ids():
    t = make()
    t.grow(2, 4)  # page 8
    t.clear(2)
    t.grow(0, 4)
    t.reorder([0, 0])  # page 0 shared by rows 0 and 1
    t.grow(1, 8)  # row 1: page 1 after its page 0
    t.grow(0, 8)  # row 0: 1 in use, home 1 in use -> recycled 8
    assert t.row(0).pages == (0, 8)
    assert t.grow(0, 12) == [9]  # then 9, right after 8: one mapping on the host backend
    assert ok(t).row(0) == Row(12, 0, (0, 8, 9))


def test_grow_validates_before_changing_anything():
    t = make()
    t.grow(0, 5)
    before = state(t)
    with pytest.raises(CapacityError, match="reservation holds 16"):
        t.grow(0, 17)
    with pytest.raises(ValueError, match=">= 0"):
        t.grow(0, -1)
    for bad in (-1, 4, True, "0", 1.0):
        with pytest.raises(IndexError, match="out of range"):
            t.grow(bad, 4)  # type: ignore[arg-type]
    assert state(ok(t)) == before


# ------------------------------------------------------------------------------------ share / fork
def test_share_points_rows_at_the_same_pages():
    t = make()
    t.grow(0, 10)  # pages 0, 1, 2
    t.share(0, 1)
    assert ok(t).row(1) == Row(10, 0, (0, 1, 2))
    assert refs(t, 0, 1, 2) == [2, 2, 2] and t.shared_pages() == 3
    t.share(0, 2, length=5)  # a prefix: the partly filled page 1 is shared too
    assert ok(t).row(2) == Row(5, 0, (0, 1))
    assert refs(t, 0, 1, 2) == [3, 3, 2]
    t.share(2, 1, length=0)  # an empty prefix empties the row
    assert ok(t).row(1) == Row() and refs(t, 0, 1, 2) == [2, 2, 1]
    t.share(0, 0, length=4)  # sharing a row's own prefix with itself drops the rest
    assert ok(t).row(0) == Row(4, 0, (0,)) and refs(t, 0, 1, 2) == [2, 1, 0]
    assert t.pool.resident_free_pages() == {2}


def test_share_replaces_the_destinations_own_pages():
    t = make()
    t.grow(0, 4)
    t.grow(1, 8)  # pages 4, 5
    t.share(0, 1)
    assert ok(t).row(1) == Row(4, 0, (0,)) and t.pool.resident_free_pages() == {4, 5}


def test_share_rejects_bad_lengths_and_dropped_prefixes():
    t = make()
    t.grow(0, 10)
    t.drop_before(0, 8)  # pages 0, 1 dropped
    before = state(t)
    with pytest.raises(ValueError, match="outside row 0's 0..10"):
        t.share(0, 1, length=11)
    with pytest.raises(ValueError, match="outside"):
        t.share(0, 1, length=-1)
    with pytest.raises(ValueError, match="dropped behind its window"):
        t.share(0, 1, length=8)  # all of it lies in dropped pages
    with pytest.raises(IndexError):
        t.share(0, 9)
    assert state(ok(t)) == before
    t.share(0, 1, length=9)  # reaches into page 2: the row starts where the source does
    assert ok(t).row(1) == Row(9, 2, (2,))


def test_assign_forks_rows_into_another_table_of_the_same_pool():
    t = make()
    t.grow(0, 6)  # pages 0, 1
    u = PageTable(t.pool, rows=2, pages_per_row=4, page_size=4)  # ids 16..23
    assert u.home(0, 0) == 16 and u.home(1, 3) == 23
    u.assign(1, t.row(0))
    assert ok(u, t).row(1) == Row(6, 0, (0, 1)) and refs(t, 0, 1) == [2, 2]
    # The pool counts references from both tables: a grow in either sees the sharing.
    assert u.grow(1, 9) == [2]  # after page 1 comes 2 (row 0's next home, free)
    assert t.grow(0, 9) == [3]  # row 0: after 1 and its home are both 2, in use: a fresh id
    assert ok(t, u).row(0) == Row(9, 0, (0, 1, 3)) and ok(u, t).row(1) == Row(9, 0, (0, 1, 2))
    u.assign(1, Row())  # dropping a fork's row returns only its own references
    assert refs(t, 0, 1, 2, 3) == [1, 1, 0, 1] and ok(u, t).row(1) == Row()


def test_assign_rejects_rows_that_do_not_fit_with_nothing_changed():
    t = make()
    t.grow(0, 6)
    t.grow(1, 4)
    before = state(t)
    with pytest.raises(ValueError, match="does not cover its length"):
        t.assign(2, Row(9, 0, (P(0), P(1))))
    with pytest.raises(ValueError, match="does not cover its length"):
        t.assign(2, Row(4, 2, ()))
    with pytest.raises(CapacityError):
        t.assign(2, Row(17, 0, tuple(P(i) for i in range(5))))
    with pytest.raises(ValueError, match="not in use"):
        t.assign(2, Row(8, 0, (P(4), P(7))))  # page 7 is free: no reference can be taken on it
    assert state(ok(t)) == before



def test_assign_rows_is_assign_of_each_row_in_one_reference_change():
    """What a fork or an install of a row of many parts does: the same tables and refcounts as
    one assign per row; a page may move from one of the rows to another in the call (assigned one
    at a time, the row letting go first would free it); a bad table, or a row given twice, changes
    nothing."""
    def grown() -> PageTable:
        t = make()
        t.grow(0, 6)  # pages 0, 1
        t.grow(1, 4)  # page 4
        return t

    a, b = grown(), grown()
    given = [(2, a.row(0)), (3, Row(3, 0, (P(4),))), (1, Row())]
    for row, table in given:
        a.assign(row, table)
    b.assign_rows(given)
    assert state(ok(a)) == state(ok(b))
    t = grown()
    t.assign_rows([(1, Row()), (2, t.row(1))])  # page 4 moves from row 1 to row 2
    assert ok(t).row(2) == Row(4, 0, (P(4),)) and t.row(1) == Row() and refs(t, 4) == [1]
    t = grown()
    with pytest.raises(ValueError, match="not in use"):  # with assign one row at a time: row 1 frees page 4 first
        t.assign(1, Row())
        t.assign(2, Row(4, 0, (P(4),)))
    t = grown()
    before = state(t)
    for bad, match in (([(2, t.row(0)), (3, Row(9, 0, (P(0),)))], "does not cover its length"),
                       ([(2, t.row(0)), (3, Row(8, 0, (P(4), P(7))))], "not in use"),
                       ([(2, t.row(0)), (2, t.row(1))], "given twice")):
        with pytest.raises(ValueError, match=match):
            t.assign_rows(bad)
        assert state(ok(t)) == before


def test_share_rows_is_share_of_each_pair_reading_every_source_first():
    """What sharing a prompt's parts with its repeats does: the same tables and refcounts as one
    share per pair; the sources are read before any row changes (a row that is a source of one
    pair and a destination of another gives its table as it was); a bad pair changes nothing."""
    def grown() -> PageTable:
        t = make()
        t.grow(0, 10)  # pages 0, 1, 2
        t.grow(1, 4)  # page 4
        return t

    a, b = grown(), grown()
    for src, dst in ((0, 2), (1, 3)):
        a.share(src, dst, length=4)
    b.share_rows([(0, 2), (1, 3)], length=4)
    assert state(ok(a)) == state(ok(b)) and b.row(2) == Row(4, 0, (P(0),)) and b.row(3) == Row(4, 0, (P(4),))
    t = grown()
    t.share_rows([(0, 1), (1, 2)])  # row 2 takes row 1's table as it was (one share at a time: row 0's)
    assert ok(t).row(2) == Row(4, 0, (P(4),)) and t.row(1) == t.row(0) and refs(t, 0, 1, 2, 4) == [2, 2, 2, 1]
    t = grown()
    before = state(t)
    for bad, length, match in (([(0, 2), (1, 3), (1, 2)], 4, "given twice"), ([(0, 2), (1, 3)], 5, "outside row 1's")):
        with pytest.raises(ValueError, match=match):
            t.share_rows(bad, length=length)
        assert state(ok(t)) == before

# ------------------------------------------------------------------------------------ copy-on-write
def test_cow_returns_exact_copy_records():
    t = make()
    t.grow(0, 10)  # pages 0, 1, 2
    t.share(0, 1)
    # Row 1 writes bytes 9..10 (page 2 only): one copy to its home page 4 + 2 = 6.
    t.grow(1, 11)
    assert ok(t).row(1) == Row(11, 0, (0, 1, 2))  # the tail page is still shared after a grow
    copies, created = t.cow(1, 9, 11)
    assert copies == [CowCopy(row=1, index=2, src=P(2), dst=P(6))] and created == [6]
    assert ok(t).row(1) == Row(11, 0, (0, 1, 6)) and t.row(0) == Row(10, 0, (0, 1, 2))
    assert refs(t, 0, 1, 2, 6) == [2, 2, 1, 1] and t.cow_copies == 1
    # Writing the now private page again copies nothing.
    assert t.cow(1, 8, 11) == ([], [])
    # Row 0 writes bytes 0..5 (pages 0 and 1, both shared): two copies, consecutive ids.
    # Its homes 0 and 1 are the shared pages themselves: fresh ids from the pool's cursor.
    copies, created = t.cow(0, 0, 5)
    assert copies == [CowCopy(0, 0, P(0), P(3)), CowCopy(0, 1, P(1), P(4))] and created == [3, 4]
    assert ok(t).row(0) == Row(10, 0, (3, 4, 2)) and refs(t, 0, 1, 2, 3, 4, 6) == [1, 1, 1, 1, 1, 1]
    assert t.cow_copies == 3 and t.shared_pages() == 0


def test_cow_hints_keep_a_rows_copies_consecutive():
    t = make()
    t.grow(0, 8)  # pages 0, 1
    t.share(0, 1)
    copies, created = t.cow(1, 0, 8)
    # Page 0's copy goes to row 1's home 4; page 1's first hint (0 + 1) is in use, its home 5 is free.
    assert copies == [CowCopy(1, 0, P(0), P(4)), CowCopy(1, 1, P(1), P(5))] and created == [4, 5]
    assert ok(t).row(1) == Row(8, 0, (4, 5)) and refs(t, 0, 1, 4, 5) == [1, 1, 1, 1]
    assert t.cow_copies == 2 and t.shared_pages() == 0


def test_cow_of_a_recycled_page_creates_nothing():
    t = make()
    t.grow(1, 4)  # page 4
    t.clear(1)  # 4 resident and free: row 1's home for index 0
    t.grow(0, 4)
    t.share(0, 1)
    assert t.cow(1, 0, 1) == ([CowCopy(1, 0, P(0), P(4))], [])
    ok(t)


def test_an_append_after_a_pages_mark_writes_in_place_once_and_the_next_row_copies():
    t = make()
    t.grow(0, 6)  # pages 0, 1: 2 bytes of page 1
    t.share(0, 1)
    t.share(0, 2)
    t.pool.set_marks({P(1): 2})  # nobody holds more than 2 bytes of page 1
    # Row 1 appends bytes 6..7 right after the mark: in place, the mark advances to 3.
    assert t.grow_and_cow([1], 6, 7) == ([], [], [])
    assert ok(t).row(1) == Row(7, 0, (0, 1)) and t.pool.marks == {P(1): 3} and t.cow_copies == 0
    # Row 2 holds 2 bytes of page 1, no longer the mark: it copies (to its home 4 + 1 = 9).
    copies, created, nbytes = t.grow_and_cow([2], 6, 7)
    assert copies == [CowCopy(2, 1, P(1), P(9))] and created == [9] and nbytes == [2]
    assert ok(t).row(2) == Row(7, 0, (0, 9)) and refs(t, 0, 1, 9) == [3, 2, 1] and P(9) not in t.pool.marks
    # The fast path appends the same way: row 1 again (3 bytes held, the mark), row 0 (2 bytes) not.
    assert t.extend_in_place([1], 7, 8) and t.row(1) == Row(8, 0, (0, 1)) and t.pool.marks == {P(1): 4}
    assert not t.extend_in_place([0], 6, 7) and t.row(0) == Row(6, 0, (0, 1))
    ok(t)


def test_two_rows_at_a_pages_mark_in_one_write_the_first_appends_and_the_second_copies():
    t = make()
    t.grow(0, 5)  # pages 0, 1: 1 byte of page 1
    t.share(0, 1)
    t.pool.set_marks({P(1): 1})
    assert not t.extend_in_place([0, 1], 5, 6)  # one page, two appenders: not the fast path
    assert t.pool.marks == {P(1): 1} and t.row(0) == Row(5, 0, (0, 1))  # nothing changed
    copies, created, _ = t.grow_and_cow([0, 1], 5, 6)
    assert copies == [CowCopy(1, 1, P(1), P(5))] and created == [5]
    assert ok(t).row(0) == Row(6, 0, (0, 1)) and t.row(1) == Row(6, 0, (0, 5)) and t.pool.marks == {P(1): 2}


def test_marks_follow_rollbacks_private_writes_and_reorder_copies():
    t = make()
    t.grow(0, 5)
    t.share(0, 1)
    t.pool.set_marks({P(1): 1})
    t.pool.begin()
    t.begin()
    t.grow_and_cow([1], 5, 6)
    assert t.pool.marks == {P(1): 2}
    t.rollback()
    t.pool.rollback()
    assert t.pool.marks == {P(1): 1} and ok(t).row(1) == Row(5, 0, (0, 1))
    # A row growing in a marked page it holds alone keeps the mark over its bytes...
    t.clear(1)
    assert t.grow_and_cow([0], 5, 7) == ([], [], []) and t.pool.marks == {P(1): 3}
    # ... the fast path drops it (a private page written: marked again when shared by a take)
    assert t.extend_in_place([0], 7, 8) and t.pool.marks == {}
    ok(t)


def test_a_reorder_tail_copy_drops_its_destinations_mark():
    t = beams()  # rows of 6 bytes: tails 1, 5, 9, 13
    t.pool.set_marks({P(1): 2, P(13): 2})
    copies = t.reorder([0, 0, 1, 0], private_tails=True)  # row 3 takes row 0's tail into its own page 13
    assert CowCopy(3, 1, P(1), P(13)) in copies and t.pool.marks == {P(1): 2}
    ok(t)


def test_an_entry_holding_more_than_its_pages_mark_breaks_the_invariant():
    t = make()
    t.grow(0, 6)
    t.pool.set_marks({P(1): 1})  # row 0 holds 2 bytes of page 1
    with pytest.raises(InvariantError, match="append mark"):
        ok(t)


def test_cow_rejects_ranges_outside_the_live_bytes_with_nothing_changed():
    t = make()
    t.grow(0, 10)
    t.share(0, 1)
    t.drop_before(1, 4)  # row 1 drops page 0
    before = state(t)
    with pytest.raises(ValueError, match="outside row 0's 0..10"):
        t.cow(0, 8, 11)
    with pytest.raises(ValueError, match="outside"):
        t.cow(0, 5, 4)
    with pytest.raises(ValueError, match="dropped behind the window"):
        t.cow(1, 3, 6)
    assert t.cow(0, 7, 7) == ([], [])  # an empty range needs nothing
    assert state(ok(t)) == before


# ------------------------------------------------------------------------------------ reorder
def test_reorder_with_duplicates_moves_only_references():
    t = make()
    for r in range(4):
        t.grow(r, 4 * (r + 1) - 1)  # row r holds r + 1 pages
    t.reorder([0, 0, 2, 2])
    assert [ok(t).row(r) for r in range(4)] == [
        Row(3, 0, (0,)), Row(3, 0, (0,)), Row(11, 0, (8, 9, 10)), Row(11, 0, (8, 9, 10))]
    assert refs(t, 0, 8, 9, 10) == [2, 2, 2, 2]
    assert t.pool.resident_free_pages() == {4, 5, 12, 13, 14, 15}
    assert t.remapped_rows == 2 and t.pool.stats().created == 10


def test_reorder_permutes_and_a_shorter_index_empties_the_remaining_rows():
    t = make()
    t.grow(0, 4)
    t.grow(1, 8)
    t.grow(2, 1)
    t.reorder([2, 0, 1])
    assert list(ok(t)) == [Row(1, 0, (8,)), Row(4, 0, (0,)), Row(8, 0, (4, 5)), Row()]
    assert t.pool.resident_free_pages() == set() and t.remapped_rows == 3
    t.reorder([1])
    assert list(ok(t)) == [Row(4, 0, (0,)), Row(), Row(), Row()]
    assert t.pool.resident_free_pages() == {8, 4, 5}
    t.reorder([])
    assert list(ok(t)) == [Row()] * 4


def test_reorder_rejects_bad_indices_with_nothing_changed():
    t = make()
    t.grow(0, 4)
    before = state(t)
    with pytest.raises(IndexError):
        t.reorder([0, 4])
    with pytest.raises(IndexError):
        t.reorder([-1])
    with pytest.raises(ValueError, match="5 entries"):
        t.reorder([0, 0, 0, 0, 0])
    assert state(ok(t)) == before


def beams() -> PageTable:
    """Four beams of 6 bytes: a shared full page 0, then each row's own partly written tail
    (row 0: page 1; rows 1, 2, 3: their home ids 5, 9, 13)."""
    t = make()
    t.grow(0, 6)
    for r in (1, 2, 3):
        t.share(0, r, length=4)
        t.grow(r, 6)
    assert [t.row(r).pages for r in range(4)] == [(0, 1), (0, 5), (0, 9), (0, 13)] and refs(t, 0) == [4]
    return t


def test_a_reorder_moves_only_the_pages_past_the_common_prefix():
    t = beams()
    before = [t.row(r) for r in range(4)]
    t.pool.begin()
    t.begin()
    t.reorder([0, 0, 1, 0])
    changed = t.changed_rows()
    t.commit()
    t.pool.commit()
    assert sorted(changed) == [1, 2, 3]  # row 0 kept its own table: not touched
    assert [ok(t).row(r) for r in range(4)] == [Row(6, 0, (0, 1)), Row(6, 0, (0, 1)), Row(6, 0, (0, 5)),
                                                 Row(6, 0, (0, 1))]
    assert refs(t, 0, 1, 5) == [4, 3, 1] and t.pool.resident_free_pages() == {9, 13}
    assert t.row(0) is before[0] and t.tail_copies == 0


def test_private_tails_copy_a_shared_tail_into_the_rows_own_page():
    t = beams()
    copies = t.reorder([0, 0, 1, 0], private_tails=True)
    # row 3's own page 13 is held by nobody after the reorder: it keeps it and gets page 1's bytes;
    # row 1's page 5 goes to row 2, so row 1 shares page 1 (copied on its next write)
    assert copies == [CowCopy(row=3, index=1, src=P(1), dst=P(13))]
    assert [ok(t).row(r).pages for r in range(4)] == [(0, 1), (0, 1), (0, 5), (0, 13)]
    assert refs(t, 0, 1, 5, 13) == [4, 2, 1, 1] and t.pool.resident_free_pages() == {9}
    assert t.tail_copies == 1 and t.remapped_rows == 2  # rows 1 and 2 took other tables; row 3 kept its own


def test_private_tails_where_remaps_cost_keep_every_rows_pages_in_order():
    t = beams()
    copies = t.reorder([0, 0, 1, 0], private_tails=True, remaps_cost=True)
    # row 2 keeps page 9 (page 5's bytes), which frees page 5 for row 1 (page 1's bytes): page 5 is
    # read before it is written, so the copies run in this order
    assert copies == [CowCopy(2, 1, P(5), P(9)), CowCopy(3, 1, P(1), P(13)), CowCopy(1, 1, P(1), P(5))]
    assert [ok(t).row(r).pages for r in range(4)] == [(0, 1), (0, 5), (0, 9), (0, 13)]  # no table changed
    assert refs(t, 0, 1, 5, 9, 13) == [4, 1, 1, 1, 1] and t.pool.resident_free_pages() == set()
    assert t.remapped_rows == 0 and t.tail_copies == 3


def test_a_swap_of_tails_copies_in_place_only_when_the_copies_are_gathered():
    t = beams()
    assert t.reorder([1, 0, 2, 3], private_tails=True, remaps_cost=True) == []  # a cycle: in order it cannot
    assert [ok(t).row(r).pages for r in range(2)] == [(0, 5), (0, 1)]  # the rows swapped tables
    copies = t.reorder([1, 0, 2, 3], private_tails=True, remaps_cost=True, gathered=True)
    assert copies == [CowCopy(0, 1, P(1), P(5)), CowCopy(1, 1, P(5), P(1))]  # every read before any write
    assert [ok(t).row(r).pages for r in range(2)] == [(0, 5), (0, 1)]  # tables kept, bytes swapped
    assert t.remapped_rows == 2 and t.tail_copies == 2


def test_private_tails_leave_full_pages_shared():
    t = make()
    t.grow(0, 8)  # two full pages: the next write takes a fresh page, nothing to copy
    t.grow(1, 8)
    assert t.reorder([0, 0], private_tails=True, remaps_cost=True) == []
    assert [ok(t).row(r).pages for r in range(2)] == [(0, 1), (0, 1)] and refs(t, 0, 1) == [2, 2]
    assert t.pool.resident_free_pages() == {4, 5}


def test_a_chain_of_beams_keeps_its_pages_past_the_written_bytes_private():
    """Beams [0, 0, 1, 2] over pages mapped ahead of the writes (a static layout): row 3 keeps its
    own pages past the written bytes (nothing to copy), which frees row 2's for row 2, and so on
    up the chain, so no page past the written bytes is shared and nothing is copied or remapped
    there (taking them outright left row 1 sharing row 0's: a copy-on-write at the next write)."""
    t = PageTable(PagePool(page_bytes=4096, budget_pages=64), rows=4, pages_per_row=8, page_size=4)
    t.grow(0, 8)  # the shared prompt: two pages
    for r in (1, 2, 3):
        t.share(0, r)
    for r in range(4):
        t.grow(r, 20)  # each row's own pages 2 (written), 3 and 4 (mapped ahead)
    assert [t.row(r).pages[2:] for r in range(4)] == [(2, 3, 4), (10, 11, 12), (18, 19, 20), (26, 27, 28)]
    assert t.reorder([0, 0, 1, 2], private_tails=True, remaps_cost=True, gathered=True, written=12) == []
    assert [ok(t).row(r).pages[2:] for r in range(4)] == [(2, 3, 4), (2, 11, 12), (10, 19, 20), (18, 27, 28)]
    assert refs(t, 2, 10, 18) == [2, 1, 1] and refs(t, 3, 4, 11, 12, 19, 20, 27, 28) == [1] * 8
    assert t.pool.resident_free_pages() == {26}


def test_a_row_that_took_a_page_outright_keeps_its_own_when_a_chain_needs_it():
    """Beams [0, 0, 1, 1] with a partly written tail page: row 3 could take row 1's tail outright
    (nobody else holds it once row 2 keeps its own), but row 1 waits for that page to keep its
    own; row 3 keeps its own instead (one copy), so row 1 can (one copy), and no tail is left
    shared for a copy-on-write at the next write. The copies run in order: each page is read
    before it is written."""
    t = PageTable(PagePool(page_bytes=4096, budget_pages=64), rows=4, pages_per_row=8, page_size=4)
    t.grow(0, 8)
    for r in (1, 2, 3):
        t.share(0, r)
    for r in range(4):
        t.grow(r, 20)  # own pages 2 (written), 3 (its first byte written) and 4 (mapped ahead)
    copies = t.reorder([0, 0, 1, 1], private_tails=True, remaps_cost=True, gathered=True, written=13)
    assert copies == [CowCopy(2, 3, P(11), P(19)), CowCopy(3, 3, P(11), P(27)), CowCopy(1, 3, P(3), P(11))]
    assert [ok(t).row(r).pages[2:] for r in range(4)] == [(2, 3, 4), (2, 11, 12), (10, 19, 20), (10, 27, 28)]
    shared_tails = [p for r in range(4) for p in t.row(r).pages[3:] if t.pool.refcount(p) > 1]
    assert shared_tails == [] and t.pool.resident_free_pages() == {18, 26}


def grouped_beams() -> PageTable:
    """Four rows of two parts each (table rows ``2r`` and ``2r + 1``), as :func:`beams` per part:
    the rows share their first page per part and each holds its own second page (row 0: pages 1
    and 5; rows 1, 2, 3: their home ids 9/13, 17/21, 25/29)."""
    t = make(rows=8)
    t.grow(0, 6)
    t.grow(1, 6)
    for r in (1, 2, 3):
        for part in (0, 1):
            t.share(part, 2 * r + part, length=4)
            t.grow(2 * r + part, 6)
    assert [t.row(r).pages for r in range(8)] == [(0, 1), (4, 5), (0, 9), (4, 13), (0, 17), (4, 21), (0, 25), (4, 29)]
    return t


GROUPS = [(0, 1), (2, 3), (4, 5), (6, 7)]


def moves(index: list[int]) -> list[int]:
    """A reorder of the rows of :func:`grouped_beams` as table rows: part ``p`` takes the same part."""
    return [2 * src + part for src in index for part in (0, 1)]


def test_a_grouped_reorder_plans_once_per_row_and_applies_it_to_every_part():
    """The plan of :func:`test_private_tails_where_remaps_cost_keep_every_rows_pages_in_order`, made
    on each row's first part, is applied to both parts: the same copies per part (in the plan's
    order, each row's parts together), no table changed."""
    t = grouped_beams()
    plan = grouped_plan(t.entries, moves([0, 0, 1, 0]), GROUPS, t.pool.refs, 4, private_tails=True,
                        remaps_cost=True, gathered=False, written=None)
    assert plan is not None
    changes, delta, copies = plan
    assert list(changes) == [] and not any(delta.values())
    assert copies == [CowCopy(4, 1, P(9), P(17)), CowCopy(5, 1, P(13), P(21)), CowCopy(6, 1, P(1), P(25)),
                      CowCopy(7, 1, P(5), P(29)), CowCopy(2, 1, P(1), P(9)), CowCopy(3, 1, P(5), P(13))]
    assert t.reorder(moves([0, 0, 1, 0]), private_tails=True, remaps_cost=True, groups=GROUPS) == copies
    assert [ok(t).row(r).pages for r in range(8)] == [(0, 1), (4, 5), (0, 9), (4, 13), (0, 17), (4, 21), (0, 25),
                                                       (4, 29)]
    assert t.tail_copies == 6 and t.remapped_rows == 0


def test_a_grouped_reorder_moves_the_same_references_as_one_per_part():
    """Without private tails (and with them, in order): the tables, refcounts, free pages and copies
    of a grouped reorder are those of the reorder planned per table row."""
    for index, tails in (([0, 0, 1, 0], False), ([0, 0, 1, 0], True), ([3, 3, 3, 3], True), ([1, 0, 2, 3], True),
                         ([2, 2], False), ([0, 0, 0, 0], False)):
        a, b = grouped_beams(), grouped_beams()
        got = a.reorder(moves(index), private_tails=tails, groups=GROUPS)
        want = b.reorder(moves(index), private_tails=tails)
        assert sorted(got) == sorted(want), index
        assert list(ok(a)) == list(ok(b)) and state(a)[2:] == state(b)[2:], index
        assert a.remapped_rows == b.remapped_rows and a.tail_copies == b.tail_copies


def test_a_repeat_of_rows_shares_every_part_of_the_first_row():
    """Prefill once: one row holds the prompt, every row then takes it (pages shared, nothing copied)."""
    t = make(rows=8)
    t.grow(0, 10)
    t.grow(1, 10)
    t.pool.begin()
    t.begin()
    before = state(t)
    t.reorder(moves([0, 0, 0, 0]), groups=GROUPS)
    assert [ok_row for ok_row in t.entries] == [Row(10, 0, (0, 1, 2)), Row(10, 0, (4, 5, 6))] * 4
    assert refs(t, 0, 1, 2, 4, 5, 6) == [4] * 6
    t.rollback()
    t.pool.rollback()
    assert state(ok(t)) == before  # one undo step for every reference moved


def test_a_part_that_does_not_follow_its_row_is_planned_on_its_own():
    """Parts that differ from their row's first part (here part 1 of row 1 lost its own tail page),
    or an index that maps a part to another part of its source, make the grouped plan step aside
    (``None``): the reorder then plans per table row, with the same result."""
    a, b = grouped_beams(), grouped_beams()
    for t in (a, b):
        t.truncate(3, 4)  # row 1, part 1: (4,) where part 0 holds (0, 9)
    assert grouped_plan(a.entries, moves([1, 1, 1, 1]), GROUPS, a.pool.refs, 4, private_tails=True,
                        remaps_cost=True, gathered=True, written=None) is None
    crossed = moves([0, 1, 2, 3])
    crossed[2], crossed[3] = 3, 2  # row 1 takes its own parts swapped
    assert grouped_plan(b.entries, crossed, GROUPS, b.pool.refs, 4, private_tails=False, remaps_cost=False,
                        gathered=True, written=None) is None
    got = a.reorder(moves([1, 1, 1, 1]), private_tails=True, remaps_cost=True, gathered=True, groups=GROUPS)
    want = b.reorder(moves([1, 1, 1, 1]), private_tails=True, remaps_cost=True, gathered=True)
    assert got == want and list(ok(a)) == list(ok(b)) and state(a)[2:] == state(b)[2:]


def test_common_prefix_finds_the_first_difference_with_or_without_a_good_guess():
    a = (1, 2, 3, 4, 5, 6, 7)
    for b, want in (((1, 2, 3, 4, 5, 6, 9), 6), ((9,) + a[1:], 0), ((1, 2, 3, 9, 5, 6, 7), 3), (a, 7),
                    (a[:4], 4), ((), 0), ((1, 2, 3, 4, 5, 6, 7, 8), 7)):
        for guess in (None, 0, 1, 3, 4, 6, 7, 9):
            assert common_prefix(a, b, guess) == want == common_prefix(b, a, guess), (b, guess)


# ------------------------------------------------------------------------------------ truncate / window
def test_truncate_drops_pages_past_the_end():
    t = make()
    t.grow(0, 15)  # pages 0..3
    t.truncate(0, 9)
    assert ok(t).row(0) == Row(9, 0, (0, 1, 2)) and t.pool.resident_free_pages() == {3}
    t.truncate(0, 8)
    assert ok(t).row(0) == Row(8, 0, (0, 1))
    t.truncate(0, 8)  # no change
    t.truncate(0, 0)
    assert ok(t).row(0) == Row() and t.pool.resident_free_pages() == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="from 0 to 1"):
        t.truncate(0, 1)


def test_truncate_of_a_shared_row_keeps_the_other_rows_pages():
    t = make()
    t.grow(0, 12)
    t.share(0, 1)
    t.truncate(1, 2)
    assert ok(t).row(1) == Row(2, 0, (0,)) and refs(t, 0, 1, 2) == [2, 1, 1]


def test_drop_before_slides_a_window():
    t = make()
    t.grow(0, 11)  # pages 0, 1, 2
    t.drop_before(0, 3)  # unit 3 is in page 0: nothing wholly behind
    assert ok(t).row(0) == Row(11, 0, (0, 1, 2))
    t.drop_before(0, 8)
    assert ok(t).row(0) == Row(11, 2, (2,)) and t.pool.resident_free_pages() == {0, 1}
    t.drop_before(0, 4)  # behind the window already: nothing to do
    assert ok(t).row(0) == Row(11, 2, (2,))
    assert t.grow(0, 14) == [3]  # after page 2 comes 3
    assert ok(t).row(0) == Row(14, 2, (2, 3))
    t.drop_before(0, 14)  # everything before unit 14: pages 2 (and 3 holds 12..13: kept)
    assert ok(t).row(0) == Row(14, 3, (3,))
    t.drop_before(0, 14)
    assert ok(t).row(0) == Row(14, 3, (3,))


def test_drop_before_the_end_of_a_full_last_page_empties_the_table_but_keeps_the_length():
    t = make()
    t.grow(0, 8)
    t.drop_before(0, 8)
    assert ok(t).row(0) == Row(8, 2, ())
    assert t.grow(0, 9) == [2]  # no previous page to follow: the slot's home
    assert ok(t).row(0) == Row(9, 2, (2,))


def test_truncate_behind_the_window_keeps_the_row_consistent():
    t = make()
    t.grow(0, 14)
    t.drop_before(0, 12)
    assert ok(t).row(0) == Row(14, 3, (3,))
    t.truncate(0, 6)  # ends in page 1, which was dropped
    assert ok(t).row(0) == Row(6, 2, ())
    t.truncate(0, 0)
    assert ok(t).row(0) == Row()


def test_drop_before_rejects_bytes_past_the_end():
    t = make()
    t.grow(0, 5)
    before = state(t)
    with pytest.raises(ValueError, match="outside row 0's 0..5"):
        t.drop_before(0, 6)
    with pytest.raises(ValueError):
        t.drop_before(0, -1)
    assert state(ok(t)) == before


# ------------------------------------------------------------------------------------ budget
def test_out_of_memory_changes_nothing_and_the_same_grow_succeeds_after_clearing():
    t = make(budget=5)
    t.grow(0, 12)  # 3 pages
    t.share(0, 1)
    before = state(t)
    with pytest.raises(KVCacheOutOfMemory) as info:
        t.grow(2, 12)  # 3 more pages: only 2 fit
    assert (info.value.requested_bytes, info.value.free_bytes, info.value.budget_bytes) == (3 * 4096, 2 * 4096,
                                                                                             5 * 4096)
    assert state(ok(t)) == before
    with pytest.raises(KVCacheOutOfMemory):
        t.cow(1, 0, 12)  # 3 copies: the same
    assert state(ok(t)) == before
    t.clear(0)  # row 1 still holds the pages: nothing freed
    with pytest.raises(KVCacheOutOfMemory):
        t.grow(2, 12)
    t.clear(1)
    assert t.grow(2, 12) == [8, 9]  # homes 8, 9 fresh (room for 2), then page 0 recycled
    assert ok(t).row(2) == Row(12, 0, (8, 9, 0)) and t.pool.stats().resident == 5


# ------------------------------------------------------------------------------------ transactions
def test_rollback_restores_rows_pool_and_counters_exactly():
    t = make()
    t.grow(0, 10)
    t.grow(1, 3)
    t.share(0, 2)
    before = state(t)
    t.pool.begin()
    t.begin()
    t.grow(3, 16)
    t.cow(2, 0, 10)
    t.reorder([2, 2, 1])
    t.truncate(0, 5)
    t.drop_before(1, 8)
    t.clear(2)
    assert set(t.changed_rows()) == {0, 1, 2, 3}
    assert t.changed_rows()[3] == Row()  # the state at begin()
    with pytest.raises(InvariantError, match="transaction"):
        t.check_invariants()
    t.rollback()
    t.pool.rollback()
    assert state(ok(t)) == before
    assert t.changed_rows() == {}


def test_commit_keeps_the_changes_and_transactions_do_not_nest():
    t = make()
    t.pool.begin()
    t.begin()
    t.grow(0, 4)
    with pytest.raises(InvariantError, match="inside an open transaction"):
        t.begin()
    t.commit()
    t.pool.commit()
    assert ok(t).row(0) == Row(4, 0, (0,))


# ------------------------------------------------------------------------------------ invariants
@pytest.mark.parametrize("corrupt, message", [
    (lambda t: t.entries.__setitem__(0, Row(9, 0, (P(0), P(1)))), "length 9 needs pages up to 3"),
    (lambda t: t.entries.__setitem__(0, Row(8, 1, (P(0), P(1)))), "length 8 needs pages up to 2"),
    (lambda t: t.entries.__setitem__(3, Row(4, 0, (P(0),))), "refcount != occurrences"),
    (lambda t: t.entries.__setitem__(3, Row(4, 0, (P(7),))), "pool says is free"),
    (lambda t: t.pool._refs.__setitem__(P(1), 3), "refcount != occurrences"),
    (lambda t: t.pool._resident_free.__setitem__(P(1), None), "both in use and free"),
])
def test_check_invariants_catches_corruption(corrupt, message):
    t = make()
    t.grow(0, 8)
    ok(t)
    corrupt(t)
    with pytest.raises(InvariantError, match=message):
        ok(t)


@pytest.mark.parametrize("corrupt, message", [
    (lambda t: t.entries.__setitem__(0, Row(9, 0, (P(0), P(1)))), "length 9 needs pages up to 3"),
    (lambda t: t.entries.__setitem__(1, Row(4, 0, (P(7),))), "row 1 holds page 7, which the pool says is free"),
])
def test_a_table_checks_its_own_rows_alone(corrupt, message):
    t = make()
    t.grow(0, 8)
    t.check_invariants()
    corrupt(t)
    with pytest.raises(InvariantError, match=message):
        t.check_invariants()


def test_a_refcount_is_checked_against_every_table_given():
    t = make()
    t.grow(0, 8)  # pages 0, 1
    u = PageTable(t.pool, rows=1, pages_per_row=4, page_size=4)
    u.assign(0, t.row(0))  # refcounts 2, 2: both tables hold them
    ok(t, u)
    with pytest.raises(InvariantError, match=r"\{0: \(2, 1\), 1: \(2, 1\)\}"):
        ok(t)  # a table left out: the pool counts references the check does not see
    t.pool._refs[P(0)] = 3  # a wrong refcount
    with pytest.raises(InvariantError, match=r"\{0: \(3, 2\)\}"):
        ok(t, u)


def test_bad_construction_is_a_value_error():
    pool = PagePool(page_bytes=4096, budget_pages=4)
    for rows, ppr, size in [(0, 1, 1), (1, 0, 1), (1, 1, 0)]:
        with pytest.raises(ValueError, match="must be positive"):
            PageTable(pool, rows=rows, pages_per_row=ppr, page_size=size)


def test_page_occurrences_count_a_repeated_tuple_once_per_occurrence():
    """What a reorder counts per page: the same as counting every page of every run, whether the
    runs are distinct tuples or one tuple taken by many rows (a repeat), or both."""
    from collections import Counter
    from itertools import chain

    a, b, c = (1, 2, 3), (3, 4), (9,)
    for runs in ([a, b, c], [a] * 5, [a, b, a, c, a, b], [], [(1, 1), (1, 1)]):
        assert _occurrences(list(runs)) == Counter(chain.from_iterable(runs)), runs


def test_kept_prefixes_name_the_rows_whose_first_pages_a_transaction_left_alone():
    """A grow keeps a row's pages (the slot below which they stay is its old end), a copy-on-write
    the pages below its first copy; any other change of the row in the transaction leaves nothing
    known, and the record ends with the transaction."""
    t = make()
    t.grow(0, 10)  # pages 0, 1, 2
    t.share(0, 1)
    t.share(0, 3)
    t.grow(2, 4)
    t.pool.begin()
    t.begin()
    t.grow(0, 14)  # a fourth page
    t.grow_and_cow([1], 9, 11)  # row 1 copies its shared page 2
    assert t.kept_prefixes() == {0: 3, 1: 2}
    t.grow_and_cow([0], 8, 12)  # row 0 again: the page it copies (shared with row 3) is below the slot known
    assert t.kept_prefixes() == {0: 2, 1: 2}
    t.truncate(1, 4)  # another change of row 1: nothing is known of it any more
    t.share(2, 3)  # row 3 changed without a hint, then grown
    t.grow(3, 6)
    assert t.kept_prefixes() == {0: 2}
    changed = t.changed_rows()
    with pytest.raises(TypeError):
        t.kept_prefixes()[1] = 0  # a view of the table's record, not to be written
    for r, kept in t.kept_prefixes().items():
        assert changed[r].start == t.row(r).start and changed[r].pages[:kept] == t.row(r).pages[:kept]
    t.rollback()
    t.pool.rollback()
    assert t.kept_prefixes() == {}
    ok(t)
