"""Executable specs of PagePool: exact page ids, refcounts and counters on tiny pools.

A pool checks what it knows alone; :func:`check_pages` checks its refcounts against the page
tables drawing from it, so these tests keep a :class:`Entries` holder (the smallest possible
"page table": a list of page ids, one per table entry) and check both after every operation.
"""

from __future__ import annotations

import dataclasses

import pytest

from hf_vkv.memory import InvariantError, KVCacheOutOfMemory, PageId, PagePool, PoolStats, check_pages

P = PageId


class Entries:
    """Stands in for a page table: the entries that hold pages, one per reference."""

    def __init__(self, pool: PagePool) -> None:
        self.pages: list[PageId] = []

    def check_invariants(self) -> None:
        """A list of ids has no invariant of its own: the pool's refcounts are checked against it."""

    def referenced_pages(self):
        return iter(self.pages)


def make(budget: int = 4, ids: int = 8) -> tuple[PagePool, Entries]:
    pool = PagePool(page_bytes=4096, budget_pages=budget)
    assert pool.add_segment(ids) == 0
    return pool, Entries(pool)


def ok(pool: PagePool, *tables: Entries) -> None:
    """The pool's own invariants and, over ``tables``, refcounts equal to entries."""
    pool.check_invariants()
    check_pages(pool, tables)


def take(pool: PagePool, entries: Entries, hints: list[list[int]]) -> tuple[list[PageId], list[PageId]]:
    pages, created = pool.allocate([[P(h) for h in hint] for hint in hints])
    entries.pages.extend(pages)
    ok(pool, entries)
    return pages, created


def drop(pool: PagePool, entries: Entries, pages: list[int]) -> list[PageId]:
    for p in pages:
        entries.pages.remove(P(p))
    freed = pool.decref([P(p) for p in pages])
    ok(pool, entries)
    return freed


def state(pool: PagePool) -> tuple:
    return (pool.stats(), pool.in_use_pages(), pool.resident_free_pages(),
            {p: pool.refcount(p) for p in pool.in_use_pages()})


def counters(pool: PagePool) -> tuple[int, int, int, int]:
    s = pool.stats()
    return s.in_use, s.resident_free, s.created, s.recycled


def test_a_new_pool_is_empty():
    pool, _ = make()
    assert pool.stats() == PoolStats(page_bytes=4096, budget_pages=4, in_use=0, resident_free=0, created=0,
                                     recycled=0, released=0, id_space=8)
    assert pool.add_segment(4) == 8 and pool.id_space == 12  # segments are consecutive
    ok(pool)


def test_allocate_takes_hinted_ids_and_free_keeps_them_resident():
    pool, entries = make()
    assert take(pool, entries, [[2], [3]]) == ([2, 3], [2, 3])  # both fresh: the backend must create them
    assert [pool.refcount(P(p)) for p in range(5)] == [0, 0, 1, 1, 0]
    assert counters(pool) == (2, 0, 2, 0)

    assert drop(pool, entries, [2]) == [2]
    assert pool.refcount(P(2)) == 0
    assert pool.in_use_pages() == {3} and pool.resident_free_pages() == {2}
    assert counters(pool) == (1, 1, 2, 0)
    assert pool.stats().resident == 2 and pool.stats().resident_bytes == 2 * 4096


def test_later_hints_are_fallbacks_and_an_empty_allocation_is_a_noop():
    pool, entries = make()
    take(pool, entries, [[5]])
    assert take(pool, entries, [[5, 6]]) == ([6], [6])  # 5 is in use: the second hint wins
    assert take(pool, entries, []) == ([], [])
    assert take(pool, entries, [[7], [7]]) == ([7, 0], [7, 0])  # one page per entry, never the same twice


def test_incref_shares_and_decref_frees_only_at_zero():
    pool, entries = make()
    take(pool, entries, [[0]])
    pool.incref([P(0), P(0)])
    entries.pages += [P(0), P(0)]
    ok(pool, entries)
    assert pool.refcount(P(0)) == 3 and pool.is_shared(P(0))
    assert drop(pool, entries, [0, 0]) == []  # still referenced once
    assert pool.refcount(P(0)) == 1 and not pool.is_shared(P(0))
    assert drop(pool, entries, [0]) == [0]
    assert not pool.is_shared(P(0)) and pool.resident_free_pages() == {0}


def test_incref_or_decref_of_a_free_page_is_a_bug():
    pool, entries = make()
    take(pool, entries, [[1]])
    drop(pool, entries, [1])
    with pytest.raises(InvariantError, match="not in use"):
        pool.incref([P(1)])
    with pytest.raises(InvariantError, match="not in use"):
        pool.decref([P(1)])
    ok(pool, entries)


def test_with_room_a_hinted_fresh_id_beats_recycling_so_rows_stay_consecutive():
    pool, entries = make()
    take(pool, entries, [[0], [1]])
    drop(pool, entries, [0])
    # Page 0 is resident and free, but the hint (2, right after page 1) keeps a row consecutive.
    assert take(pool, entries, [[2]]) == ([2], [2])
    assert pool.resident_free_pages() == {0}


def test_a_hinted_resident_free_page_is_recycled():
    pool, entries = make()
    take(pool, entries, [[0], [1]])
    drop(pool, entries, [0, 1])
    assert take(pool, entries, [[1]]) == ([1], [])  # recycled: nothing to create
    assert counters(pool) == (1, 1, 2, 1)


def test_without_a_usable_hint_resident_free_pages_are_recycled_oldest_first_before_fresh_ids():
    pool, entries = make(budget=8)
    take(pool, entries, [[4], [5], [6]])
    drop(pool, entries, [6])
    drop(pool, entries, [4])
    # Hints on pages in use (or no hints): recycle 6 (freed first), then 4, then make fresh ids.
    assert take(pool, entries, [[5], [], []]) == ([6, 4, 0], [0])
    assert counters(pool) == (4, 0, 4, 2)


def test_unhinted_fresh_ids_are_consecutive_from_a_cursor():
    pool, entries = make(budget=8)
    assert take(pool, entries, [[], [], []]) == ([0, 1, 2], [0, 1, 2])
    drop(pool, entries, [0, 1, 2])
    pool.take_releasable()  # no longer resident: the next ones are fresh again
    assert take(pool, entries, [[], []]) == ([3, 4], [3, 4])


def test_at_the_budget_recycling_replaces_fresh_memory():
    pool, entries = make(budget=3)
    take(pool, entries, [[0], [1], [2]])
    drop(pool, entries, [0, 1])
    # Resident = budget: a hinted fresh id (5) would exceed it, so the oldest free page is taken.
    assert take(pool, entries, [[5]]) == ([0], [])
    assert take(pool, entries, [[5], ]) == ([1], [])
    assert pool.stats().resident == 3
    with pytest.raises(KVCacheOutOfMemory):
        take(pool, entries, [[5]])


def test_out_of_memory_is_raised_before_anything_changes_and_the_same_request_succeeds_after_a_free():
    pool, entries = make(budget=4)
    take(pool, entries, [[0], [1], [2]])
    before = state(pool)
    with pytest.raises(KVCacheOutOfMemory) as info:
        pool.allocate([[P(3)], [P(4)]])
    err = info.value
    assert (err.requested_bytes, err.free_bytes, err.budget_bytes) == (2 * 4096, 1 * 4096, 4 * 4096)
    assert "8,192" in str(err) and "budget_bytes" in str(err)  # says what was asked and what to do
    assert state(pool) == before
    ok(pool, entries)

    drop(pool, entries, [1])
    assert take(pool, entries, [[3], [4]]) == ([3, 1], [3])  # 4 would exceed the budget: recycle 1
    assert pool.stats().resident == 4


def test_take_releasable_gives_back_the_oldest_free_pages_beyond_keep():
    pool, entries = make(budget=8)
    take(pool, entries, [[0], [1], [2], [3]])
    drop(pool, entries, [2])
    drop(pool, entries, [0])
    drop(pool, entries, [3])
    assert pool.take_releasable(keep=1) == [2, 0]
    assert pool.resident_free_pages() == {3} and pool.stats().released == 2
    assert pool.take_releasable(keep=5) == []
    assert pool.take_releasable() == [3]
    assert counters(pool) == (1, 0, 4, 0) and pool.stats().released == 3
    ok(pool, entries)
    # A released id is fresh again: taking it creates memory anew.
    assert take(pool, entries, [[2]]) == ([2], [2])


def test_rollback_restores_every_counter_set_and_refcount_exactly():
    pool, entries = make(budget=6)
    take(pool, entries, [[0], [1], [2]])
    drop(pool, entries, [1])
    before = state(pool)
    pool.begin()
    pool.allocate([[P(1)], [P(4)]])  # recycles 1, creates 4
    pool.incref([P(0)])
    pool.decref([P(2), P(0)])
    assert pool.take_releasable() == [2]
    pool.add_segment(3)
    with pytest.raises(InvariantError, match="transaction"):
        ok(pool, entries)
    with pytest.raises(InvariantError, match="inside an open transaction"):
        pool.begin()
    pool.rollback()
    assert state(pool) == before
    ok(pool, entries)
    # The restored pool behaves as before: 1 is still resident and free.
    assert take(pool, entries, [[1]]) == ([1], [])


def test_commit_keeps_the_changes():
    pool, entries = make()
    pool.begin()
    pages, _ = pool.allocate([[P(0)]])
    pool.commit()
    entries.pages += pages
    pool.rollback()  # nothing open: a no-op
    assert pool.in_use_pages() == {0}
    ok(pool, entries)


@pytest.mark.parametrize("corrupt, message", [
    (lambda pool: pool._refs.__setitem__(P(0), 2), "refcount != occurrences"),
    (lambda pool: pool._refs.__setitem__(P(0), 0), "refcount 0"),
    (lambda pool: pool._resident_free.__setitem__(P(0), None), "both in use and free"),
    (lambda pool: pool._resident_free.__setitem__(P(99), None), "outside the id space"),
    (lambda pool: pool._resident_free.update({P(5): None, P(6): None, P(7): None}), "exceed the budget"),
    (lambda pool: pool._refs.pop(P(1)), "refcount != occurrences"),
])
def test_check_invariants_catches_corruption(corrupt, message):
    pool, entries = make()
    take(pool, entries, [[0], [1]])
    ok(pool, entries)
    corrupt(pool)
    with pytest.raises(InvariantError, match=message):
        ok(pool, entries)


def test_check_pages_counts_every_table_given():
    pool, entries = make()
    take(pool, entries, [[0]])
    other = Entries(pool)
    other.pages.append(P(0))  # a second table holds page 0 without a reference: a bug
    with pytest.raises(InvariantError, match=r"\{0: \(1, 2\)\}"):
        ok(pool, entries, other)
    pool.incref([P(0)])
    ok(pool, entries, other)


@pytest.mark.parametrize("kwargs", [dict(page_bytes=0, budget_pages=1), dict(page_bytes=4096, budget_pages=-1)])
def test_bad_construction_is_a_value_error(kwargs):
    with pytest.raises(ValueError, match="page_bytes|budget_pages"):
        PagePool(**kwargs)
    with pytest.raises(ValueError, match="num_pages"):
        PagePool(page_bytes=1, budget_pages=1).add_segment(-1)


def test_stats_is_a_snapshot():
    pool, entries = make()
    before = pool.stats()
    take(pool, entries, [[0]])
    assert before.in_use == 0 and pool.stats().in_use == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.in_use = 3  # type: ignore[misc]
