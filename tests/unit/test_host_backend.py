"""The host backend on real memory: a memfd as physical pages, mmap to place them.

What the kernel says (``/proc/self/maps``, ``/proc/self/smaps``, the memfd's allocated blocks) is
the oracle here, not the backend's own bookkeeping.
"""

from __future__ import annotations

import gc
import mmap
import weakref

import pytest
import torch

from hf_vkv.memory import Arena, BackendError, CacheClosedError, HostBackend, PageId, VirtualBuffer
from hf_vkv.memory.runs import consecutive_runs

PAGE = 4096
P = PageId


def vmas(lo: int, hi: int) -> list[tuple[int, int, str, int, str]]:
    """``(start, end, perms, offset, path)`` of the mappings inside ``[lo, hi)``."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if start < hi and end > lo:
                out.append((start, end, fields[1], int(fields[2], 16), fields[5] if len(fields) > 5 else ""))
    return out


def count_maps() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.fixture
def backend():
    b = HostBackend(page_bytes=PAGE, name="hf_vkv-test-host")
    b.ensure_id_space(16)
    yield b
    b.close()


def test_page_bytes_must_be_a_multiple_of_the_os_page():
    for bad in (0, -PAGE, mmap.PAGESIZE + 1):
        with pytest.raises(ValueError, match="multiple of the OS page size"):
            HostBackend(page_bytes=bad)


def test_id_space_costs_no_memory_and_is_checked(backend):
    backend.ensure_id_space(1 << 18)  # 1 GiB of page ids
    backend.ensure_id_space(4)  # never shrinks
    assert backend.resident_bytes() == 0
    assert backend.pool_tensor().shape == (1 << 18, PAGE)
    backend.create([P(0), P((1 << 18) - 1)])
    with pytest.raises(BackendError, match="create failed: page 262144 is outside"):
        backend.create([P(1 << 18)])
    address = backend.reserve(2 * PAGE)
    with pytest.raises(BackendError, match="outside id space"):
        backend.map(address, [P((1 << 18) - 1), P(1 << 18)])
    backend.unreserve(address, 2 * PAGE)


def test_reserve_is_aligned_and_inaccessible_until_mapped(backend):
    b = HostBackend(page_bytes=4 * PAGE)
    address = b.reserve(3 * 4 * PAGE)
    assert address % (4 * PAGE) == 0
    assert vmas(address, address + 12 * PAGE) == [(address, address + 12 * PAGE, "---p", 0, "")]
    with pytest.raises(ValueError, match="multiple of page_bytes"):
        b.reserve(PAGE)
    with pytest.raises(BackendError, match="no reservation"):
        b.unreserve(address, PAGE)
    b.unreserve(address, 12 * PAGE)
    assert vmas(address, address + 12 * PAGE) == []
    b.close()


def test_a_page_mapped_twice_is_one_page_of_memory(backend, rss):
    address = backend.reserve(4 * PAGE)
    backend.create([P(3)])
    backend.map(address, [P(3)])
    backend.map(address + 2 * PAGE, [P(3)])
    view = backend.tensor(address, 4 * PAGE, owner=None)
    view[:PAGE] = 7
    assert view[2 * PAGE:3 * PAGE].eq(7).all()  # the write is visible at the other address
    view[2 * PAGE + 5] = 9
    assert view[5] == 9
    assert backend.resident_bytes() == PAGE  # the memfd holds one page ...
    assert rss(address, address + 4 * PAGE) == 2 * PAGE  # ... which RSS counts twice
    assert backend.pool_tensor()[3, 5] == 9  # and the pool view sees the same page
    backend.unmap(address, 4 * PAGE // PAGE)
    backend.unreserve(address, 4 * PAGE)


def test_consecutive_ids_become_one_mapping(backend):
    address = backend.reserve(8 * PAGE)
    backend.map(address, [P(4), P(5), P(6)])
    backend.map(address + 3 * PAGE, [P(7)])  # continues the run: the kernel merges it
    backend.map(address + 5 * PAGE, [P(1), P(2), P(9)])
    assert vmas(address, address + 8 * PAGE) == [
        (address, address + 4 * PAGE, "rw-s", 4 * PAGE, "/memfd:hf_vkv-test-host"),
        (address + 4 * PAGE, address + 5 * PAGE, "---p", 0, ""),
        (address + 5 * PAGE, address + 7 * PAGE, "rw-s", 1 * PAGE, "/memfd:hf_vkv-test-host"),
        (address + 7 * PAGE, address + 8 * PAGE, "rw-s", 9 * PAGE, "/memfd:hf_vkv-test-host"),
    ]
    backend.unmap(address + PAGE, 6)
    # Unmapping re-reserves: the range stays ours (no hole another mmap could take).
    assert [v[2] for v in vmas(address, address + 8 * PAGE)] == ["rw-s", "---p", "rw-s"]
    assert vmas(address, address + 8 * PAGE)[1][:2] == (address + PAGE, address + 7 * PAGE)
    backend.unmap(address, 8)
    backend.unreserve(address, 8 * PAGE)


def test_release_punches_a_hole(backend):
    address = backend.reserve(4 * PAGE)
    backend.create([P(0), P(1), P(2)])
    backend.map(address, [P(0), P(1), P(2)])
    view = backend.tensor(address, 3 * PAGE, owner=None)
    view.fill_(5)
    assert backend.resident_bytes() == 3 * PAGE
    backend.unmap(address, 3)
    backend.release([P(2), P(0)])
    assert backend.resident_bytes() == PAGE
    backend.release([P(1)])
    assert backend.resident_bytes() == 0
    # The memory is gone, not just unmapped: a hole reads as zeros. (Reading a memfd hole through
    # a mapping allocates a page again, which is why views never cover pages that are not in use.)
    assert backend.pool_tensor()[:3].eq(0).all()
    assert backend.resident_bytes() == 3 * PAGE
    backend.unreserve(address, 4 * PAGE)


def test_copy_copies_whole_pages(backend):
    pool = backend.pool_tensor()
    backend.create([P(0), P(1), P(2)])
    pool[0] = torch.arange(PAGE, dtype=torch.int64).to(torch.uint8)
    pool[1] = 3
    backend.copy([(P(0), P(2)), (P(1), P(0))])
    assert torch.equal(pool[2], torch.arange(PAGE, dtype=torch.int64).to(torch.uint8))
    assert pool[0].eq(3).all()
    backend.copy([])


def test_a_view_keeps_its_owner_alive(backend):
    class Owner:
        pass

    owner = Owner()
    address = backend.reserve(PAGE)
    backend.map(address, [P(0)])
    view = backend.tensor(address, PAGE, owner)[10:20]
    ref = weakref.ref(owner)
    del owner
    gc.collect()
    assert ref() is not None
    del view
    gc.collect()
    assert ref() is None
    assert backend.tensor(address, 0, None).shape == (0,)
    backend.unmap(address, 1)
    backend.unreserve(address, PAGE)


def test_use_after_close_raises_cache_closed_error():
    b = HostBackend(page_bytes=PAGE, name="hf_vkv-test-closed")
    b.ensure_id_space(4)
    address = b.reserve(PAGE)
    b.map(address, [P(0)])
    view = b.tensor(address, PAGE, None)
    view[0] = 1
    b.close()
    b.close()  # idempotent
    for call in (lambda: b.create([P(0)]), lambda: b.release([P(0)]), lambda: b.resident_bytes(),
                 lambda: b.map(address, [P(0)]), lambda: b.ensure_id_space(8), lambda: b.pool_tensor()):
        with pytest.raises(CacheClosedError, match="closed"):
            call()
    assert view[0] == 1  # a live mapping keeps its memory until it is unmapped
    b.unmap(address, 1)
    b.unreserve(address, PAGE)
    assert not any("hf_vkv-test-closed" in v[4] for v in vmas(0, 1 << 64))


@pytest.mark.slow  # a 64 x 10,000-page reservation: 13-23 s on a loaded 2-core machine
def test_64_rows_of_10000_pages_stay_far_below_max_map_count():
    """Consecutive ids for a row's consecutive pages let the kernel merge them: the number of
    mappings stays flat however many pages the rows hold (Linux allows ``vm.max_map_count``)."""
    with open("/proc/sys/vm/max_map_count") as f:
        max_map_count = int(f.read())
    rows, pages, chunk, item = 64, 10_000, 500, 16
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-many"))
    buf = VirtualBuffer(arena, rows=rows, capacity=pages * PAGE // item, item_bytes=item)
    before = count_maps()
    lo, hi = buf.address, buf.address + rows * buf.row_stride
    most = 0
    for end in range(chunk, pages + 1, chunk):  # interleaved: every row grows a chunk in turn
        for r in range(rows):
            buf.grow([r], end * PAGE // item)
        most = max(most, len(vmas(lo, hi)))
    assert arena.pool.stats().in_use == rows * pages
    assert most <= 2 * rows + 1  # per row at most its mapped run and the reserved rest
    added = count_maps() - before
    assert added < 1000 and count_maps() + 1000 < max_map_count
    assert arena.backend.resident_bytes() == 0  # mapped is not touched
    last = buf.view(range(rows), pages * PAGE // item - 1, pages * PAGE // item)  # the last item of each row
    last.fill_(1)
    assert arena.backend.resident_bytes() == rows * PAGE
    buf.check_invariants()
    buf.close()
    assert arena.closed and arena.pool.stats().in_use == 0 and arena.pool.stats().released == rows * pages
    del buf, last
    gc.collect()
    assert not any("hf_vkv-test-many" in v[4] for v in vmas(0, 1 << 64))


@pytest.mark.parametrize(("values", "runs"), [
    ([], []),
    ([7], [(7, 1)]),
    ([3, 4, 5, 9, 2, 3], [(3, 3), (9, 1), (2, 2)]),
    ((5, 5, 6), [(5, 1), (5, 2)]),  # a repeated id starts a new run
    ([4, 3, 2], [(4, 1), (3, 1), (2, 1)]),
    (range(10, 14), [(10, 4)]),
])
def test_consecutive_runs_are_maximal_in_order(values, runs) -> None:
    assert list(consecutive_runs(values)) == runs
