"""Executable spec of :mod:`hf_vkv.memory.held_pages`: holders with shared pages, each page's bytes
counted once while any holder holds it."""

from __future__ import annotations

import pytest

from hf_vkv.memory import InvariantError
from hf_vkv.memory.held_pages import HeldPages, PageCounts

A, B = object(), object()  # two page stores


def test_a_page_held_by_two_holders_counts_once_until_both_are_removed() -> None:
    first = HeldPages.of([(A, 4096, [3, 4, 5]), (B, 8192, [0])])
    second = HeldPages.of([(A, 4096, [5, 6, 6, 3])])  # an id held twice by one holder is held once
    assert first.nbytes == 3 * 4096 + 8192 and second.nbytes == 3 * 4096
    assert set(first) & set(second) == {(A, 3), (A, 5)} and len(first) == 4  # the pages both hold, by key
    counts = PageCounts()
    counts.add(first)
    counts.add(second)
    assert counts.bytes == 4 * 4096 + 8192  # pages 3..6 of A, page 0 of B
    counts.remove(first)
    assert counts.bytes == 3 * 4096  # 3, 5, 6 are still held by the second
    counts.remove(second)
    assert counts.bytes == 0 and counts.same_as(PageCounts())


def test_a_store_whose_pages_are_all_gone_is_not_kept_alive() -> None:
    import gc
    import weakref

    class Store:
        pass

    store = Store()
    gone = weakref.ref(store)
    counts = PageCounts()
    held = HeldPages.of([(store, 4096, [7])])
    counts.add(held)
    counts.remove(held)
    del store, held
    gc.collect()
    assert gone() is None


def test_removing_what_was_not_added_raises_and_changes_nothing() -> None:
    counts = PageCounts()
    held = HeldPages.of([(A, 4096, [1, 2])])
    counts.add(held)
    before = PageCounts()
    before.add(held)
    with pytest.raises(InvariantError):
        counts.remove(HeldPages.of([(A, 4096, [2, 9])]))
    with pytest.raises(InvariantError):
        counts.remove(HeldPages.of([(B, 4096, [1])]))
    with pytest.raises(InvariantError):
        counts.remove(HeldPages(tensors={"t": 64}))
    assert counts.same_as(before) and counts.bytes == 2 * 4096


def test_kept_tensors_count_once_per_key() -> None:
    counts = PageCounts()
    counts.add(HeldPages(tensors={"t": 100}))
    counts.add(HeldPages(tensors={"t": 100, "u": 28}))
    assert counts.bytes == 128
    counts.remove(HeldPages(tensors={"t": 100}))
    assert counts.bytes == 128
    counts.remove(HeldPages(tensors={"t": 100, "u": 28}))
    assert counts.bytes == 0


def test_same_as_compares_the_counts_of_every_page() -> None:
    one, other = PageCounts(), PageCounts()
    one.add(HeldPages.of([(A, 4096, [1])]))
    other.add(HeldPages.of([(A, 4096, [2])]))
    assert one.bytes == other.bytes and not one.same_as(other)
    one.add(HeldPages.of([(A, 4096, [1])]))
    other.add(HeldPages.of([(A, 4096, [1, 2])]))
    assert not one.same_as(other)  # page 1 held twice, against page 1 once and page 2 twice


def test_ids_far_apart_cost_what_is_held_not_the_id_space() -> None:
    """A store's ids grow with the rows' capacity (a 10**9-token capacity gives ~10**10 ids): the
    counts hold the ids held, never one count per id up to the largest (a dense count was 45 GB).
    Adding, comparing and removing such holders takes no memory to speak of."""
    import resource

    far = [10**8, 10**8 + 1, 3 * 10**8]  # dense: 1.2 GB of counts, copied to compare
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    counts, again = PageCounts(), PageCounts()
    first, second = HeldPages.of([(A, 4096, far)]), HeldPages.of([(A, 4096, [5, 10**8 + 1])])
    for c in (counts, again):
        c.add(first)
        c.add(second)
    assert counts.bytes == 4 * 4096 and counts.same_as(again)
    counts.remove(first)
    assert counts.bytes == 2 * 4096 and not counts.same_as(again)
    again.remove(first)
    assert counts.same_as(again)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: under 64 MiB more
