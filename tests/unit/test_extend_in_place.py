"""``PageTable.extend_in_place``: the decode step's cheap path, with exact ids (pages of 4 units)."""

from __future__ import annotations

from hf_vkv.memory import PageId, PagePool, PageTable, Row

P = PageId


def _table() -> PageTable:
    return PageTable(PagePool(page_bytes=4096, budget_pages=64), rows=3, pages_per_row=4, page_size=4)


def test_a_write_inside_the_last_private_page_only_sets_lengths() -> None:
    table = _table()
    table.grow(0, 5)
    table.grow(1, 5)
    before = table.pool.stats()
    assert table.extend_in_place([0, 1], 5, 7)
    assert table.row(0) == Row(7, 0, (P(0), P(1))) and table.row(1) == Row(7, 0, (P(4), P(5)))
    assert table.pool.stats() == before  # no page taken
    table.check_invariants()


def test_a_write_that_needs_a_new_page_changes_nothing() -> None:
    table = _table()
    table.grow(0, 8)
    assert not table.extend_in_place([0], 8, 9)
    assert table.row(0) == Row(8, 0, (P(0), P(1)))
    table.check_invariants()


def test_a_write_into_a_shared_page_changes_nothing_in_any_row() -> None:
    table = _table()
    table.grow(0, 5)
    table.grow(2, 5)
    table.share(0, 1)  # rows 0 and 1 hold pages 0 and 1
    assert not table.extend_in_place([2, 1], 5, 6)
    assert table.row(2).length == 5 and table.row(1).length == 5  # row 2 was fine, but all or nothing
    table.check_invariants()


def test_a_write_behind_a_dropped_window_or_past_the_length_takes_the_slow_path() -> None:
    table = _table()
    table.grow(0, 9)
    table.drop_before(0, 4)
    assert not table.extend_in_place([0], 2, 10)  # unit 2 lies in a dropped page
    assert not table.extend_in_place([0], 10, 11)  # starts past the row's 9 units
    assert table.row(0).length == 9
    table.check_invariants()


def test_rows_at_different_starts_and_a_write_over_several_pages_are_checked_page_by_page() -> None:
    """A write spanning pages 1 and 2 (units 6..10) in rows whose tables start at different page
    indices (row 0 dropped page 0 behind a window): every page in the range is checked in each
    row, whatever its start, and one shared page anywhere leaves every row as it was."""
    table = _table()
    table.grow(0, 11)
    table.grow(1, 11)
    table.drop_before(0, 4)
    assert table.row(0) == Row(11, 1, (P(1), P(2))) and table.row(1) == Row(11, 0, (P(4), P(5), P(6)))
    assert table.extend_in_place([0, 1], 6, 12)
    assert table.row(0) == Row(12, 1, (P(1), P(2))) and table.row(1) == Row(12, 0, (P(4), P(5), P(6)))
    table.share(1, 2)  # rows 1 and 2 now hold pages 4, 5, 6: page 5 lies in the range, shared
    assert not table.extend_in_place([0, 1], 6, 12)
    assert not table.extend_in_place([0, 2], 5, 12)
    assert table.row(0).length == table.row(1).length == 12
    assert table.extend_in_place([0], 5, 12) and not table.extend_in_place([-1], 5, 12)  # out of range: slow path
    assert table.extend_in_place([], 0, 3)  # no row: nothing to do
    table.check_invariants()


def test_rows_of_one_start_but_different_lengths_take_the_slow_path() -> None:
    """Row 1 holds 2 pages where the write needs 3: the cheap path says no (before it reads any
    page of row 1 past its table), and no row changes."""
    table = _table()
    table.grow(0, 11)
    table.grow(1, 5)
    assert not table.extend_in_place([0, 1], 5, 12) and not table.extend_in_place([1, 0], 9, 10)
    assert table.row(0) == Row(11, 0, (P(0), P(1), P(2))) and table.row(1) == Row(5, 0, (P(4), P(5)))
    table.check_invariants()
