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
