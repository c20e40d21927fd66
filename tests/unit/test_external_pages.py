"""External pages: a mapped file's pages in the pool (pinned, never written, retired for good) and
in the host backend (mapped ``MAP_PRIVATE`` read-only from the file, copied out of on write)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from hf_vkv.memory import Arena, BackendError, HostBackend, InvariantError, PageId, PagePool, Row, VirtualBuffer
from hf_vkv.memory.invariants import check_pages

PAGE = 16384


def test_an_external_page_is_pinned_and_retires_when_no_table_holds_it() -> None:
    pool = PagePool(page_bytes=PAGE, budget_pages=3)
    pool.add_segment(3)
    own, _ = pool.allocate([[]])
    ext = pool.add_external(3)
    assert [pool.refcount(p) for p in ext] == [1, 1, 1] and pool.stats().external == 3
    assert pool.stats().in_use == 1  # outside the budget: the file's memory, not the pool's
    pool.incref(ext[:2])
    pool.incref(ext[:1])
    assert pool.is_shared(ext[0]) and pool.is_shared(ext[1])  # a table never finds one unshared
    assert pool.retire_unheld(ext) == [ext[2]]  # no table holds it
    pool.begin()
    assert pool.decref([ext[1]]) == []  # only the pin left: retired, not freed
    pool.rollback()
    assert pool.refcount(ext[1]) == 2  # a rollback restores it
    pool.decref([ext[1]])
    pool.adjust({ext[0]: -1})
    assert pool.refcount(ext[0]) == 2
    pool.adjust({ext[0]: -1})
    assert pool.refcount(ext[0]) == 0 and pool.stats().external == 0
    assert pool.resident_free_pages() == set()  # a retired page is never recycled ...
    taken, _ = pool.allocate([[ext[0]], [ext[1]]])  # ... nor handed out, even when hinted
    assert not set(taken) & set(ext)
    pool.check_invariants()
    assert own


def test_external_pages_can_take_their_holders_references_with_their_pins() -> None:
    """``holds``: page i starts with its pin and holds[i] references (what incref per holder
    would give); a page nobody holds retires at once; a bad ``holds`` changes nothing."""
    pool = PagePool(page_bytes=PAGE, budget_pages=2)
    pool.add_segment(2)
    with pytest.raises(ValueError):
        pool.add_external(3, holds=[1, 1])
    with pytest.raises(ValueError):
        pool.add_external(2, holds=[1, -1])
    assert pool.id_space == 2
    ext = pool.add_external(4, holds=[1, 2, 0, 1])
    assert [pool.refcount(p) for p in ext] == [2, 3, 0, 2] and pool.stats().external == 3
    taken, _ = pool.allocate([[ext[2]]])  # the unheld page retired: never handed out
    assert taken != [ext[2]]
    pool.decref([ext[0], ext[1], ext[1], ext[3]])
    assert pool.stats().external == 0
    pool.check_invariants()
    alike = pool.add_external(3, holds=[2, 2, 2])  # every page held alike (one path), then none held
    assert list(alike) == list(range(ext[-1] + 1, ext[-1] + 4)) and [pool.refcount(p) for p in alike] == [3, 3, 3]
    none = pool.add_external(2, holds=[0, 0])
    assert [pool.refcount(p) for p in none] == [0, 0] and pool.stats().external == 3
    pool.decref([p for p in alike for _ in range(2)])
    assert pool.stats().external == 0
    pool.check_invariants()


def test_the_pool_check_catches_a_mark_on_an_external_page() -> None:
    pool = PagePool(page_bytes=PAGE, budget_pages=4)
    ext = pool.add_external(1)
    pool.incref(ext)
    pool.set_marks({ext[0]: 100})
    with pytest.raises(InvariantError, match="append marks"):
        pool.check_invariants()


def test_add_external_is_refused_inside_a_transaction() -> None:
    pool = PagePool(page_bytes=PAGE, budget_pages=4)
    pool.begin()
    with pytest.raises(InvariantError):
        pool.add_external(1)
    pool.rollback()


def _file(tmp_path: Path, pages: int, offset: int) -> tuple[int, torch.Tensor]:
    data = torch.randint(0, 256, (pages, PAGE), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    path = tmp_path / "pages.kv"
    path.write_bytes(b"\0" * offset + data.numpy().tobytes())
    return os.open(path, os.O_RDONLY), data


def test_a_row_maps_file_pages_reads_them_and_copies_before_it_writes(tmp_path: Path) -> None:
    fd, data = _file(tmp_path, 3, PAGE)
    arena = Arena(HostBackend(page_bytes=PAGE))
    buf = VirtualBuffer(arena, rows=2, capacity=4 * PAGE, item_bytes=1)
    ext = arena.map_file(fd, PAGE, 3)
    os.close(fd)  # the backend keeps its own descriptor
    file_bytes = (tmp_path / "pages.kv").read_bytes()
    buf.install(0, [Row(3 * PAGE - 100, 0, tuple(ext))])  # the last page partly filled
    check_pages(arena.pool, arena.tables())
    assert arena.backend.resident_bytes() == 0
    assert torch.equal(buf.view(range(0, 1), 0, 3 * PAGE - 100)[0], data.flatten()[:3 * PAGE - 100])
    buf.share(0, [1])
    buf.prepare_write([1], 3 * PAGE - 100, 3 * PAGE + 10)  # row 1 writes into the last mapped page
    row1 = buf.table.row(buf.table_rows(1)[0])
    assert row1.pages[:2] == tuple(ext[:2]) and row1.pages[2] not in ext  # a copy in the memfd
    view = buf.view(range(1, 2), 0, 3 * PAGE + 10)[0]
    assert torch.equal(view[:3 * PAGE - 100], data.flatten()[:3 * PAGE - 100])  # the copy holds the file's bytes
    view[3 * PAGE - 100:].fill_(7)
    assert (tmp_path / "pages.kv").read_bytes() == file_bytes  # never written
    buf.prepare_write([0], 3 * PAGE - 100, 3 * PAGE - 50)  # row 0 too: its own copy, not the file page
    assert buf.table.row(buf.table_rows(0)[0]).pages[2] not in ext
    check_pages(arena.pool, arena.tables())
    buf.clear([0, 1])
    assert arena.pool.stats().external == 0  # retired
    arena.pool.check_invariants()
    buf.close()


def test_map_file_refuses_what_the_file_does_not_hold(tmp_path: Path) -> None:
    fd, _ = _file(tmp_path, 2, 0)
    arena = Arena(HostBackend(page_bytes=PAGE))
    buf = VirtualBuffer(arena, rows=1, capacity=PAGE, item_bytes=1)  # keeps the arena open
    with pytest.raises(BackendError, match="holds"):
        arena.map_file(fd, 0, 3)
    with pytest.raises(BackendError, match="offset"):
        arena.map_file(fd, 100, 1)
    assert arena.pool.stats().external == 0  # nothing kept
    arena.pool.check_invariants()
    os.close(fd)
    buf.close()


def test_read_pages_reads_memfd_and_file_pages(tmp_path: Path) -> None:
    fd, data = _file(tmp_path, 2, 0)
    backend = HostBackend(page_bytes=PAGE)
    backend.ensure_id_space(4)
    backend.create([PageId(0)])
    backend.pool_tensor()[0].fill_(9)
    backend.map_file(fd, 0, [PageId(2), PageId(3)])
    os.close(fd)
    got = backend.read_pages([PageId(3), PageId(0), PageId(2)])
    assert torch.equal(got[0], data[1]) and bool((got[1] == 9).all()) and torch.equal(got[2], data[0])
    backend.close()


@pytest.mark.parametrize("nbytes", [None, [PAGE - 24] * 3, [100, PAGE, 8]])
def test_one_copy_reads_file_and_memfd_sources_before_it_writes(tmp_path: Path, nbytes: list[int] | None) -> None:
    """A copy whose sources are a mapped file's pages and memfd pages (a reorder of rows that took
    a fresh row's tails): each destination gets its source's written bytes, and a destination that
    is also a source is read before it is written."""
    fd, data = _file(tmp_path, 2, 0)
    backend = HostBackend(page_bytes=PAGE)
    backend.ensure_id_space(8)
    backend.create([PageId(i) for i in range(4)])
    pool = backend.pool_tensor()
    for i in range(4):
        pool[i].fill_(10 + i)
    backend.map_file(fd, 0, [PageId(6), PageId(7)])
    os.close(fd)
    before = pool[:4].clone()
    backend.copy([(PageId(7), PageId(0)), (PageId(0), PageId(1)), (PageId(6), PageId(3))], nbytes)
    sizes = nbytes or [PAGE] * 3
    for dst, source, n in ((0, data[1], sizes[0]), (1, before[0], sizes[1]), (3, data[0], sizes[2])):
        assert torch.equal(pool[dst, :n], source[:n])
        assert torch.equal(pool[dst, n:], before[dst, n:])  # past the written part: untouched
    assert torch.equal(pool[2], before[2])
    with pytest.raises(BackendError, match="page 7 is a page of a mapped file"):
        backend.copy([(PageId(0), PageId(7))])
    backend.close()
