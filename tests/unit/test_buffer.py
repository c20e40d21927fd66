"""VirtualBuffer on the host backend: tables, kernel mappings and bytes kept in step.

Geometry: 4 KiB pages, 24-byte items (so items straddle pages: item 170 is split between pages 0
and 1), 700 items a row -> a row stride of 5 pages; row ``r``'s page index ``i`` prefers id
``5 * r + i``. After every operation the kernel's mappings (``/proc/self/maps``) must be exactly
what the page table says (the ``mapped_pages`` fixture) and the invariants must hold.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_vkv.memory import (
    Arena,
    BufferStats,
    CacheClosedError,
    CapacityError,
    HostBackend,
    InvariantError,
    KVCacheOutOfMemory,
    PageId,
    Row,
    VirtualBuffer,
)

PAGE, ITEM, CAP = 4096, 24, 700
P = PageId


@pytest.fixture
def new(mapped_pages):
    """``new(rows=4, budget_bytes=None)`` makes a buffer; ``new.ok(buf)`` checks it."""
    made: list[VirtualBuffer] = []

    def make(rows: int = 4, *, budget_bytes: int | None = None, capacity: int = CAP) -> VirtualBuffer:
        arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-buffer"), budget_bytes=budget_bytes)
        buf = VirtualBuffer(arena, rows=rows, capacity=capacity, item_bytes=ITEM)
        made.append(buf)
        return buf

    def ok(*bufs: VirtualBuffer) -> None:
        for buf in bufs:
            buf.check_invariants()
            mapped_pages(buf)

    make.ok = ok  # type: ignore[attr-defined]
    yield make
    for buf in made:
        buf.close()


def fill(buf: VirtualBuffer, row: int, start: int, end: int, seed: int) -> torch.Tensor:
    """Write random bytes to items ``[start, end)`` of ``row`` (after prepare_write); return them."""
    buf.prepare_write([row], start, end)
    data = torch.randint(0, 256, ((end - start) * ITEM,), dtype=torch.uint8,
                         generator=torch.Generator().manual_seed(seed))
    buf.view(range(row, row + 1), start, end)[0] = data
    return data


def read(buf: VirtualBuffer, row: int, start: int = 0, end: int | None = None) -> torch.Tensor:
    return buf.view(range(row, row + 1), start, buf.length(row) if end is None else end)[0].clone()


# ------------------------------------------------------------------------------------ geometry / views
def test_rows_are_page_aligned_strided_views(new):
    buf = new()
    assert buf.row_stride == 5 * PAGE and buf.address % PAGE == 0
    assert [buf.length(r) for r in range(4)] == [0, 0, 0, 0]
    buf.grow([0, 1, 2], 200)  # 4800 bytes: 2 pages a row
    new.ok(buf)
    assert [buf.table.row(r) for r in range(3)] == [Row(4800, 0, (P(0), P(1))), Row(4800, 0, (P(5), P(6))),
                                                    Row(4800, 0, (P(10), P(11)))]
    view = buf.view(range(0, 3), 100, 200)  # [rows, items * item_bytes]
    assert view.shape == (3, 100 * ITEM) and view.stride() == (5 * PAGE, 1) and view.dtype == torch.uint8
    assert view.data_ptr() == buf.address + 100 * ITEM
    view.copy_(torch.arange(3 * 100 * ITEM).reshape(3, -1).to(torch.uint8))
    assert torch.equal(read(buf, 1, 100, 200), torch.arange(100 * ITEM, 200 * ITEM).to(torch.uint8))
    assert buf.view(range(1, 1), 0, 0).shape == (0, 0)


def test_an_item_that_straddles_two_pages_reads_back_whole(new):
    buf = new()
    data = fill(buf, 0, 168, 173, seed=1)  # items 168..172: item 170 spans bytes 4080..4104
    assert buf.table.row(0) == Row(173 * ITEM, 0, (P(0), P(1)))
    assert torch.equal(read(buf, 0, 168, 173), data)
    new.ok(buf)


def test_views_never_cover_unmapped_items(new):
    buf = new()
    buf.grow([0], 300)
    buf.grow([1], 100)
    with pytest.raises(ValueError, match=r"items \[0, 101\) of row 1 are not mapped \(it holds \[0, 100\)\)"):
        buf.view(range(1, 2), 0, 101)
    with pytest.raises(ValueError, match="row 1 are not mapped"):
        buf.view(range(0, 2), 0, 200)  # every row of the range must hold the items
    with pytest.raises(ValueError, match="not mapped"):
        buf.view(range(0, 1), 5, 4)
    with pytest.raises(ValueError, match="rows must be a range with step 1"):
        buf.view(range(0, 2, 2), 0, 1)
    with pytest.raises(ValueError, match="rows must be a range"):
        buf.view([0], 0, 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows must be a range"):
        buf.view(range(3, 5), 0, 0)
    buf.drop_before([0], 200)  # page 0 (items 0..169, and the first half of item 170) dropped
    assert buf.first_live(0) == 171
    with pytest.raises(ValueError, match=r"it holds \[171, 300\)"):
        buf.view(range(0, 1), 170, 171)
    assert buf.view(range(0, 1), 171, 300).shape == (1, 129 * ITEM)
    new.ok(buf)


# ------------------------------------------------------------------------------------ sharing is aliasing
def test_shared_rows_alias_the_same_memory_until_copy_on_write(new, rss):
    buf = new()
    a = fill(buf, 0, 0, 300, seed=2)  # 7200 bytes: pages 0, 1
    resident = buf.store.backend.resident_bytes()
    assert resident == 2 * PAGE
    buf.share(0, [1, 2])
    new.ok(buf)
    assert buf.table.row(1) == buf.table.row(2) == buf.table.row(0) == Row(7200, 0, (P(0), P(1)))
    assert buf.store.backend.resident_bytes() == resident  # sharing allocated nothing
    assert torch.equal(read(buf, 2), a)

    # A raw write through row 0's view, deliberately skipping prepare_write, shows in rows 1 and 2:
    # they are the same physical pages, not copies.
    buf.view(range(0, 1), 10, 11)[0] = 0xAB
    assert read(buf, 1, 10, 11).eq(0xAB).all() and read(buf, 2, 10, 11).eq(0xAB).all()
    a[10 * ITEM:11 * ITEM] = 0xAB

    # Memory is counted once per page, not once per mapping as RSS does.
    stats = buf.stats()
    assert stats == BufferStats(page_bytes=PAGE, mapped_slots=6, distinct_pages=2, shared_pages=2,
                                resident_bytes=2 * PAGE, live_bytes=7200, cow_copies=0,
                                mappings=6)  # each row's two pages (consecutive ids: one mapping), then its unmapped rest
    assert stats.resident_bytes == buf.store.backend.resident_bytes()
    buf.view(range(0, 3), 0, 300).sum()  # read every row: each mapping gets its page-table entries
    assert rss(buf.address, buf.address + 4 * buf.row_stride) == 6 * PAGE  # RSS: 3x the truth
    assert buf.store.backend.resident_bytes() == 2 * PAGE

    # prepare_write copies the shared page the write touches (and only it); then rows are separate.
    buf.prepare_write([1], 180, 181)  # item 180 lies in page 1
    assert buf.table.row(1) == Row(7200, 0, (P(0), P(6))) and buf.stats().cow_copies == 1
    new.ok(buf)
    assert buf.store.backend.resident_bytes() == 3 * PAGE
    assert torch.equal(read(buf, 1), a)  # the copy holds the same bytes
    buf.view(range(1, 2), 180, 181)[0] = 0xCD
    assert read(buf, 1, 180, 181).eq(0xCD).all()
    assert torch.equal(read(buf, 0), a) and torch.equal(read(buf, 2), a)
    # Page 0 is still shared by all three rows.
    buf.view(range(2, 3), 0, 1)[0] = 0xEF
    assert read(buf, 0, 0, 1).eq(0xEF).all() and read(buf, 1, 0, 1).eq(0xEF).all()


def test_sharing_a_prefix_shares_its_partly_filled_last_page(new):
    buf = new()
    a = fill(buf, 0, 0, 250, seed=3)
    buf.share(0, [1], length=200)  # item 199 ends in page 1, which holds items up to 249 of row 0
    assert buf.table.row(1) == Row(4800, 0, (P(0), P(1))) and buf.length(1) == 200
    assert buf.store.pool.refcount(P(1)) == 2
    new.ok(buf)
    b = fill(buf, 1, 200, 260, seed=4)  # row 1 grows into the shared page: it gets its own copy
    assert buf.table.row(1) == Row(260 * ITEM, 0, (P(0), P(6)))
    assert torch.equal(read(buf, 0), a)  # row 0's items 200..249 were not touched
    assert torch.equal(read(buf, 1), torch.cat([a[:200 * ITEM], b]))
    new.ok(buf)


# ------------------------------------------------------------------------------------ fork
def test_fork_shares_every_page_with_a_new_buffer(new):
    buf = new()
    a = fill(buf, 0, 0, 300, seed=5)
    b = fill(buf, 1, 0, 100, seed=6)
    resident = buf.store.backend.resident_bytes()
    other = buf.fork()
    new.ok(buf, other)
    assert other.store is buf.store and other.address != buf.address
    assert list(other.table) == list(buf.table)
    assert [buf.store.pool.refcount(P(p)) for p in (0, 1, 5)] == [2, 2, 2]
    assert buf.store.backend.resident_bytes() == resident
    assert torch.equal(read(other, 0), a) and torch.equal(read(other, 1), b)

    c = fill(other, 0, 50, 60, seed=7)  # copy-on-write across buffers
    assert other.table.row(0).pages == (P(20), P(1))  # the fork's segment starts at 4 rows * 5 pages
    assert torch.equal(read(buf, 0), a)
    assert torch.equal(read(other, 0), torch.cat([a[:50 * ITEM], c, a[60 * ITEM:]]))
    new.ok(buf, other)

    buf.close()  # the fork keeps the pages it shares
    assert torch.equal(read(other, 1), b) and not buf.store.closed
    assert buf.store.pool.in_use_pages() == {20, 1, 5}
    other.close()
    assert buf.store.closed and buf.store.pool.stats().in_use == 0


def test_fork_into_fewer_rows(new):
    buf = new()
    fill(buf, 1, 0, 10, seed=8)
    small = buf.fork(rows=2)
    assert small.rows == 2 and small.table.row(1) == buf.table.row(1)
    new.ok(buf, small)
    with pytest.raises(ValueError, match=r"cannot fork into 1 rows: rows \[1\] hold items"):
        buf.fork(rows=1)
    new.ok(buf)
    small.close()


# ------------------------------------------------------------------------------------ reorder / window
def test_reorder_with_duplicates_remaps_rows_without_copying(new):
    buf = new()
    data = [fill(buf, r, 0, 100 * (r + 1), seed=10 + r) for r in range(4)]
    resident = buf.store.backend.resident_bytes()
    buf.reorder([0, 0, 2, 2])
    new.ok(buf)
    assert [read(buf, r).shape[0] for r in range(4)] == [2400, 2400, 7200, 7200]
    for r, src in enumerate([0, 0, 2, 2]):
        assert torch.equal(read(buf, r), data[src])
    assert buf.store.backend.resident_bytes() == resident  # no copies
    assert buf.store.pool.resident_free_pages() == {5, 6, 15, 16, 17}
    fill(buf, 3, 0, 1, seed=20)  # rows 2 and 3 are separate after a write
    assert torch.equal(read(buf, 2), data[2])
    buf.reorder([3])
    assert [buf.length(r) for r in range(4)] == [300, 0, 0, 0]
    new.ok(buf)


def test_a_beam_reorder_with_private_tails_copies_tails_in_place_and_remaps_nothing(new, monkeypatch):
    buf = new()
    prompt = fill(buf, 0, 0, 200, seed=1)  # 4800 bytes: page 0 full, page 1 partly written
    buf.share(0, [1, 2, 3])
    tails = [fill(buf, r, 200, 210, seed=2 + r) for r in range(4)]  # each row copies page 1 on write
    own = [buf.table.row(r) for r in range(4)]
    assert [row.pages for row in own] == [(P(0), P(2)), (P(0), P(6)), (P(0), P(11)), (P(0), P(1))]  # row 3 wrote last
    calls = []
    monkeypatch.setattr(buf.store.backend, "map", lambda *a: calls.append(a))
    buf.reorder([0, 0, 1, 0], private_tails=True)
    assert calls == [] and [buf.table.row(r) for r in range(4)] == own  # same pages, same mappings
    assert buf.table.tail_copies == 3 and buf.table.remapped_rows == 0 and buf.stats().tail_copies == 3
    new.ok(buf)
    for r, src in enumerate([0, 0, 1, 0]):
        assert torch.equal(read(buf, r), torch.cat([prompt, tails[src]]))
    monkeypatch.undo()
    more = fill(buf, 1, 210, 211, seed=9)  # each tail is the row's own: the write needs no copy-on-write
    assert buf.table.cow_copies == 3 and torch.equal(read(buf, 1), torch.cat([prompt, tails[0], more]))


def test_beams_that_swap_histories_swap_tail_bytes_and_keep_their_pages(new):
    buf = new(rows=2)
    prompt = fill(buf, 0, 0, 200, seed=1)
    buf.share(0, [1])
    tails = [fill(buf, r, 200, 210, seed=2 + r) for r in range(2)]
    own = [buf.table.row(r) for r in range(2)]
    buf.reorder([1, 0], private_tails=True)  # a cycle: the host copies every source before any destination
    assert [buf.table.row(r) for r in range(2)] == own and buf.table.tail_copies == 2
    new.ok(buf)
    for r, src in enumerate([1, 0]):
        assert torch.equal(read(buf, r), torch.cat([prompt, tails[src]]))


def test_a_reorder_keeps_the_rows_own_pages_mapped_ahead_of_the_written_items(new):
    buf = new()
    prompt = fill(buf, 0, 0, 200, seed=1)
    buf.share(0, [1, 2, 3])
    tails = [fill(buf, r, 200, 210, seed=2 + r) for r in range(4)]
    buf.grow(range(4), 400)  # pages mapped ahead (the static layout's): page 2 of each row, unwritten
    own = [buf.table.row(r) for r in range(4)]
    buf.reorder([1, 1, 0, 0], private_tails=True, written=210)
    # page 1 of each row gets its source's 10 written items, page 2 stays as it is: nothing moved
    assert [buf.table.row(r) for r in range(4)] == own and buf.table.tail_copies == 3
    new.ok(buf)
    for r, src in enumerate([1, 1, 0, 0]):
        assert torch.equal(read(buf, r, 0, 210), torch.cat([prompt, tails[src]]))


def test_truncate_and_drop_before_unmap_the_pages_they_drop(new):
    buf = new()
    a = fill(buf, 0, 0, 600, seed=21)  # 14400 bytes: pages 0..3
    buf.truncate([0], 400)  # 9600 bytes: pages 0..2
    assert buf.table.row(0) == Row(9600, 0, (P(0), P(1), P(2)))
    new.ok(buf)
    buf.truncate([0, 1], 500)  # longer than row 0, and row 1 is empty: nothing happens
    assert buf.length(0) == 400 and buf.length(1) == 0
    buf.drop_before([0], 350)  # byte 8400 lies in page 2: pages 0, 1 dropped
    assert buf.table.row(0) == Row(9600, 2, (P(2),)) and buf.first_live(0) == 342  # 8192 / 24 -> 342
    new.ok(buf)
    assert torch.equal(read(buf, 0, 342), a[342 * ITEM:400 * ITEM])
    buf.drop_before([0], 10_000)  # the last page is not wholly before the end: kept
    assert buf.table.row(0) == Row(9600, 2, (P(2),))
    with pytest.raises(ValueError, match="dropped behind the window"):
        buf.prepare_write([0], 300, 401)
    buf.grow([0], 600)  # page index 3 again: page 3 follows page 2 (resident, recycled)
    assert buf.table.row(0) == Row(14400, 2, (P(2), P(3))) and buf.store.pool.stats().created == 4
    new.ok(buf)
    assert torch.equal(read(buf, 0, 342, 400), a[342 * ITEM:400 * ITEM])
    buf.truncate([0], 100)  # truncating behind the window leaves nothing mapped
    assert buf.table.row(0) == Row(2400, 1, ()) and buf.first_live(0) == buf.length(0) == 100  # none live
    new.ok(buf)
    assert buf.view(range(0, 1), 100, 100).shape == (1, 0)
    buf.clear([0])
    assert buf.table.row(0) == Row() and buf.first_live(0) == 0
    new.ok(buf)


# ------------------------------------------------------------------------------------ reuse / budget
def test_refilling_cleared_rows_recycles_pages_and_keeps_memory_flat(new):
    buf = new()
    for cycle in range(5):
        for r in range(4):
            fill(buf, r, 0, 300 + 50 * r, seed=cycle * 4 + r)
        buf.reorder([1, 1, 3, 0])  # beams: some rows dropped, some duplicated
        fill(buf, 0, 340, 345, seed=99)  # a write into a shared page: copy-on-write
        new.ok(buf)
        if cycle == 0:
            resident, created = buf.store.backend.resident_bytes(), buf.store.pool.stats().created
        buf.clear(range(4))
        new.ok(buf)
        assert buf.store.pool.stats().in_use == 0
    stats = buf.store.pool.stats()
    assert stats.created == created and stats.recycled > 0  # every later cycle recycled
    assert buf.store.backend.resident_bytes() == resident == stats.resident_bytes
    assert buf.store.trim(keep_bytes=2 * PAGE) == stats.resident_bytes - 2 * PAGE
    assert buf.store.backend.resident_bytes() == 2 * PAGE and buf.store.pool.stats().resident_free == 2
    assert buf.store.trim() == 2 * PAGE and buf.store.backend.resident_bytes() == 0


def test_out_of_memory_changes_nothing_and_the_same_call_succeeds_after_clearing(new, buffer_snapshot):
    buf = new(budget_bytes=6 * PAGE + 100)  # 6 pages
    fill(buf, 0, 0, 300, seed=30)  # 2 pages
    buf.share(0, [1])
    before = buffer_snapshot(buf)
    with pytest.raises(KVCacheOutOfMemory) as info:
        buf.grow([2, 3], 500)  # 3 pages a row: row 2 would fit, row 3 not, so neither grows
    assert isinstance(info.value, MemoryError)
    # The error names what the call asked: 6 pages for the two rows, 4 free, 6 in the budget.
    assert (info.value.requested_bytes, info.value.free_bytes, info.value.budget_bytes) == (
        6 * PAGE, 4 * PAGE, 6 * PAGE)
    assert buffer_snapshot(buf) == before
    new.ok(buf)
    buf.grow([2], 500)
    before = buffer_snapshot(buf)
    with pytest.raises(KVCacheOutOfMemory):
        buf.prepare_write([0, 1], 0, 300)  # row 0 needs 2 copies (row 1 then owns the originals)
    assert buffer_snapshot(buf) == before
    buf.clear([2])  # pages 10, 11, 12 stay resident: the copies recycle them
    buf.prepare_write([0, 1], 0, 300)
    new.ok(buf)
    assert buf.table.row(0) == Row(7200, 0, (P(10), P(11))) and buf.table.row(1) == Row(7200, 0, (P(0), P(1)))
    assert buf.store.pool.stats().resident == 5 and buf.stats().shared_pages == 0


# ------------------------------------------------------------------------------------ close / leaks
def test_closing_the_last_buffer_releases_every_page(faulty_backend):
    backend = faulty_backend(page_bytes=PAGE, name="hf_vkv-test-close")  # records the memory at close
    arena = Arena(backend)
    buf = VirtualBuffer(arena, rows=4, capacity=CAP, item_bytes=ITEM)
    fill(buf, 0, 0, 600, seed=40)
    buf.share(0, [1, 2])
    fill(buf, 2, 0, 10, seed=41)
    other = buf.fork()
    buf.clear([0])  # some pages free but resident
    assert backend.resident_bytes() == 5 * PAGE
    buf.close()
    buf.close()  # idempotent
    assert not arena.closed and arena.pool.stats().in_use == 5
    other.close()
    assert arena.closed and backend.resident_bytes_at_close == 0
    stats = arena.pool.stats()
    assert (stats.in_use, stats.resident_free, stats.released) == (0, 0, stats.created)
    with pytest.raises(CacheClosedError, match="arena was closed"):
        VirtualBuffer(arena, rows=1, capacity=1, item_bytes=1)


def test_a_buffer_that_is_garbage_collected_returns_its_pages():
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-gc"))
    buf = VirtualBuffer(arena, rows=2, capacity=CAP, item_bytes=ITEM)
    keep = buf.fork()
    fill(buf, 0, 0, 300, seed=42)
    del buf
    gc.collect()
    assert arena.pool.stats().in_use == 0 and arena.pool.stats().resident_free == 2 and not arena.closed
    del keep
    gc.collect()
    assert arena.closed and arena.pool.stats().resident == 0
    with open("/proc/self/maps") as f:
        assert "hf_vkv-test-gc" not in f.read()  # no mapping of the memfd is left


def test_every_use_after_close_raises_cache_closed_error(new):
    buf = new()
    fill(buf, 0, 0, 10, seed=43)
    buf.close()
    assert buf.closed
    calls = [
        lambda: buf.length(0), lambda: buf.first_live(0), lambda: buf.view(range(0, 1), 0, 1),
        lambda: buf.stats(), lambda: buf.check_invariants(), lambda: buf.grow([0], 20),
        lambda: buf.prepare_write([0], 0, 1), lambda: buf.share(0, [1]), lambda: buf.reorder([0]),
        lambda: buf.truncate([0], 0), lambda: buf.drop_before([0], 0), lambda: buf.clear([0]),
        lambda: buf.fork(),
    ]
    for call in calls:
        with pytest.raises(CacheClosedError, match="closed"):
            call()


# ------------------------------------------------------------------------------------ bad input
def test_bad_input_raises_typed_errors_and_changes_nothing(new, buffer_snapshot):
    buf = new()
    fill(buf, 0, 0, 300, seed=44)
    buf.share(0, [1], length=200)
    buf.drop_before([1], 171)  # row 1 drops page 0
    assert buf.first_live(1) == 171
    before = buffer_snapshot(buf)
    bad = [
        (CapacityError, "do not fit: rows were reserved for 700", lambda: buf.grow([2], 701)),
        (CapacityError, "reserved for 700", lambda: buf.prepare_write([2], 0, 701)),
        (ValueError, "length must be >= 0", lambda: buf.grow([2], -1)),
        (IndexError, "row 4 is out of range", lambda: buf.grow([2, 4], 10)),  # row 2 would grow first
        (IndexError, "out of range", lambda: buf.grow([-1], 10)),
        (ValueError, r"invalid write range \[5, 4\)", lambda: buf.prepare_write([0], 5, 4)),
        (ValueError, "invalid write range", lambda: buf.prepare_write([0], -1, 4)),
        (ValueError, "dropped behind the window", lambda: buf.prepare_write([2, 1], 0, 5)),
        (ValueError, "outside row 0's", lambda: buf.share(0, [2, 3], length=301)),
        (ValueError, "outside row 0's", lambda: buf.share(0, [2], length=-1)),
        (IndexError, "out of range", lambda: buf.share(0, [2, 9])),
        (IndexError, "out of range", lambda: buf.reorder([0, 1, 4])),
        (ValueError, "5 entries", lambda: buf.reorder([0, 0, 0, 0, 0])),
        (ValueError, "cannot truncate", lambda: buf.truncate([0], -1)),
        (IndexError, "out of range", lambda: buf.truncate([0, 7], 1)),
        (ValueError, "outside row 0's", lambda: buf.drop_before([0], -1)),
        (IndexError, "out of range", lambda: buf.clear([0, 4])),
        (IndexError, "out of range", lambda: buf.length(4)),
    ]
    for error, message, call in bad:
        with pytest.raises(error, match=message):
            call()
        assert buffer_snapshot(buf) == before, message
    new.ok(buf)


def test_bad_construction_is_a_value_error():
    arena = Arena(HostBackend(page_bytes=PAGE))
    for rows, capacity, item in [(0, 1, 1), (1, 0, 1), (1, 1, 0)]:
        with pytest.raises(ValueError, match="must be positive"):
            VirtualBuffer(arena, rows=rows, capacity=capacity, item_bytes=item)
    assert not arena.closed  # a failed constructor gave its open count back: the arena is unused
    with pytest.raises(ValueError, match="smaller than one page"):
        Arena(HostBackend(page_bytes=PAGE), budget_bytes=PAGE - 1)
    arena.backend.close()


def test_check_invariants_sees_a_corrupted_table(new):
    buf = new()
    buf.grow([0], 300)
    buf.check_invariants()
    buf.table.entries[1] = buf.table.row(0)  # a second reference without a refcount
    with pytest.raises(InvariantError, match="refcount != occurrences"):
        buf.check_invariants()
    buf.table.entries[1] = Row()


def test_check_invariants_sees_a_wrong_refcount_anywhere_in_the_store(new):
    buf = new()
    buf.grow([0], 300)
    fork = buf.fork()  # a second buffer of the same arena: its table holds the same pages
    new.ok(buf, fork)
    pool = buf.store.pool
    page = buf.table.row(0).pages[0]
    assert pool.refcount(page) == 2
    pool._refs[page] = 3  # a wrong refcount
    for b in (buf, fork):
        with pytest.raises(InvariantError, match=rf"\{{{page}: \(3, 2\)\}}"):
            b.check_invariants()
    pool._refs[page] = 2
    fork.table.entries[1] = fork.table.row(0)  # a reference in the other buffer only
    with pytest.raises(InvariantError, match="refcount != occurrences"):
        buf.check_invariants()
    fork.table.entries[1] = Row()
    fork.close()  # a closed buffer's table no longer counts
    assert buf.store.tables() == [buf.table]
    new.ok(buf)


def test_slot_changes_told_which_first_pages_stayed_give_the_runs_of_a_full_comparison():
    """What a table says of a changed row (its pages below a slot stayed: a grow, a copy-on-write
    of later pages) lets the mapping plan skip comparing them; the runs come out the same as a
    comparison of every slot, over random grows, copies and both."""
    import random

    from hf_vkv.memory.virtual_buffer import _slot_changes

    rng = random.Random(5)
    for _ in range(2000):
        start = rng.randrange(0, 4)
        old_pages = tuple(rng.randrange(100) for _ in range(rng.randrange(1, 40)))
        end = start + len(old_pages)
        kept = rng.randrange(start, end + 1)  # slots below it stay
        new_pages = list(old_pages)
        for i in range(kept - start, len(new_pages)):  # copy-on-write of some later pages
            if rng.random() < 0.3:
                new_pages[i] = 100 + rng.randrange(100)
        new_pages += [200 + rng.randrange(100) for _ in range(rng.randrange(0, 5))]  # a grow
        old, new = Row(end * 4, start, old_pages), Row(len(new_pages) * 4 + start * 4, start, tuple(new_pages))
        every: list[tuple[int, list, list]] = []  # the runs, slot by slot
        for i in range(start, max(old.end, new.end)):
            before = old.pages[i - start] if i < old.end else None
            after = new.pages[i - start] if i < new.end else None
            if before != after:
                if every and every[-1][0] + len(every[-1][1]) == i:
                    every[-1][1].append(before)
                    every[-1][2].append(after)
                else:
                    every.append((i, [before], [after]))
        expected = [(first, list(b), list(a)) for first, b, a in every]
        for told in (kept, None):
            got = [(first, list(b), list(a)) for first, b, a in _slot_changes(old, new, told)]
            assert got == expected, (old, new, told)
