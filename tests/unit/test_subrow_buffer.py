"""Executable specs of :class:`hf_vkv.memory.SubRowBuffer` (the head-major translator): which
page-table rows hold each row's parts, and the strides of its views after every row operation.

Geometry: 3 rows of 2 blocks x 2 heads (4 parts each, 12 table rows), 4 KiB pages, 16-byte items,
256 items a sub-row (one page). Table row of (block g, row r, head h) = ``(g * 3 + r) * 2 + h``.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_vkv.memory import Arena, HostBackend, Row, SubRowBuffer

PAGE, ITEM, ROWS, BLOCKS, HEADS = 4096, 16, 3, 2, 2


@pytest.fixture
def buf(mapped_pages):
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-subrows"))
    b = SubRowBuffer(arena, rows=ROWS, blocks=BLOCKS, heads=HEADS, capacity=PAGE // ITEM, item_bytes=ITEM)
    yield b
    b.check_invariants()
    mapped_pages(b)
    b.close()
    assert arena.closed


def fill(b: SubRowBuffer, row: int, end: int, value: int) -> None:
    """Write ``value + part`` into every byte of items ``[0, end)`` of ``row``'s parts."""
    b.prepare_write([row], 0, end)
    view = b.view(range(row, row + 1), 0, end)  # [blocks, 1, heads, end * item]
    for g in range(BLOCKS):
        for h in range(HEADS):
            view[g, 0, h] = value + g * HEADS + h


def test_table_rows_of_each_row_are_exact() -> None:
    arena = Arena(HostBackend(page_bytes=PAGE))
    b = SubRowBuffer(arena, rows=ROWS, blocks=BLOCKS, heads=HEADS, capacity=8, item_bytes=ITEM)
    assert b.parts == 4 and b.table.rows == 12
    assert [list(b.table_rows(r)) for r in range(ROWS)] == [[0, 1, 6, 7], [2, 3, 8, 9], [4, 5, 10, 11]]
    with pytest.raises(IndexError, match="row 3 is out of range for 3 rows"):
        b.table_rows(3)
    with pytest.raises(ValueError, match="blocks and heads must be positive, got 0, 2"):
        SubRowBuffer(arena, rows=1, blocks=0, heads=2, capacity=8, item_bytes=ITEM)
    b.close()


def test_a_block_view_is_one_batch_of_rows_times_heads(buf: SubRowBuffer) -> None:
    buf.grow(range(ROWS), 10)
    view = buf.view(range(0, ROWS), 2, 10)
    s = buf.row_stride
    assert view.shape == (BLOCKS, ROWS, HEADS, 8 * ITEM)
    assert view.stride() == (ROWS * HEADS * s, HEADS * s, s, 1)
    assert view.stride(1) == HEADS * view.stride(2)  # stride(row) == heads * stride(head)
    assert view[1].flatten(0, 1).shape == (ROWS * HEADS, 8 * ITEM)  # a [B * H, T] batch, no copy
    assert view.data_ptr() == buf.address + 2 * ITEM
    part = buf.view(range(1, 3), 0, 4)
    assert part.data_ptr() == buf.address + 1 * HEADS * s  # row 1, head 0 of block 0: table row 2


def test_grow_maps_every_part_of_the_rows_only(buf: SubRowBuffer) -> None:
    buf.grow([1], 5)
    held = {t for t in range(buf.table.rows) if buf.table.row(t).pages}
    assert held == {2, 3, 8, 9}
    assert all(buf.table.row(t) == Row(5 * ITEM, 0, (buf.table.row(t).pages[0],)) for t in held)
    assert [buf.length(r) for r in range(ROWS)] == [0, 5, 0]


def test_share_reorder_and_fork_act_on_each_part(buf: SubRowBuffer) -> None:
    fill(buf, 0, 6, value=10)
    buf.share(0, [2])
    for g in range(BLOCKS):  # each part shares the page of the same part: no mixing of heads or blocks
        for h in range(HEADS):
            assert buf.table.row((g * ROWS + 2) * HEADS + h).pages == buf.table.row((g * ROWS + 0) * HEADS + h).pages
    assert buf.stats().shared_pages == BLOCKS * HEADS
    fill(buf, 2, 6, value=50)  # copy-on-write per part: row 0 keeps its bytes
    assert buf.table.cow_copies == BLOCKS * HEADS
    assert torch.equal(buf.view(range(0, 1), 0, 6)[:, 0, :, 0], torch.tensor([[10, 11], [12, 13]], dtype=torch.uint8))
    buf.reorder([2, 2, 0])
    got = buf.view(range(0, ROWS), 0, 6)[:, :, :, 0]  # [blocks, rows, heads]
    assert got[:, 0].tolist() == got[:, 1].tolist() == [[50, 51], [52, 53]]
    assert got[:, 2].tolist() == [[10, 11], [12, 13]]
    fork = buf.fork(rows=3)
    try:
        assert [fork.table.row(t).pages for t in range(12)] == [buf.table.row(t).pages for t in range(12)]
        view = fork.view(range(0, 3), 0, 6)
        assert view.stride(1) == HEADS * view.stride(2)
        assert torch.equal(view, buf.view(range(0, 3), 0, 6))
        buf.check_invariants()  # both buffers' tables are counted
    finally:
        fork.close()


def test_crop_and_window_apply_to_every_part(buf: SubRowBuffer) -> None:
    buf.grow([0], 256)  # one full page per part
    buf.truncate([0], 100)
    assert {buf.table.row(t).length for t in buf.table_rows(0)} == {100 * ITEM}
    buf.drop_before([0], 100)  # item 100 is inside page 0: nothing lies wholly before it
    assert buf.first_live(0) == 0
    buf.clear([0])
    assert all(buf.table.row(t) == Row() for t in buf.table_rows(0))


def test_shared_items_follow_sharing_reorder_and_copy_on_write() -> None:
    """``shared_items``: the items two rows hold on the same pages (the cascade attention's prefix)."""
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-shared"))
    b = SubRowBuffer(arena, rows=ROWS, blocks=BLOCKS, heads=HEADS, capacity=4 * PAGE // ITEM, item_bytes=ITEM)
    per_page = PAGE // ITEM  # 256 items
    b.prepare_write([0], 0, 600)  # 3 pages, the last partly filled
    b.share(0, [1, 2], length=600)
    assert [b.shared_items(0, r) for r in (1, 2)] == [600, 600]
    b.prepare_write([1], 600, 601)  # row 1 writes into the shared third page: copy on write
    assert b.shared_items(0, 1) == 2 * per_page and b.shared_items(1, 0) == 2 * per_page
    assert b.shared_items(0, 2) == 600
    b.reorder([1, 1, 2])  # beam reorder: rows 0 and 1 both take row 1's pages
    assert b.shared_items(0, 1) == 601 and b.shared_items(0, 2) == 2 * per_page
    b.check_shared_parts(range(ROWS))
    b.clear([2])
    assert b.shared_items(0, 2) == 0
    b.close()


def test_growing_repeating_stepping_and_clearing_many_rows_leave_the_garbage_collector_alone(mapped_pages) -> None:
    """A prefill of one row of SmolLM2's shape (30 layers x K/V = 60 blocks, 3 heads, 32 pages a
    sub-row, the last one half written), its repeat into 64 rows (prefill once), their first
    decode step (a copy of the shared last page per sub-row), seven steps inside their own last
    pages and their clearing make no record per page or per sub-row that lives through the call
    beside the rows' new tables: each counted towards the cyclic garbage collector's threshold
    (700 objects), and the prefill, the repeat, the seven steps and the clearing set it off 10,
    90, 112 and 84 times, promoting enough objects that a process with SmolLM2 loaded ran a full
    collection (0.16 s) every few calls. Pages, rows and mappings are as the table says after."""
    arena = Arena(HostBackend(page_bytes=PAGE, name="hf_vkv-test-subrows"))
    b = SubRowBuffer(arena, rows=64, blocks=60, heads=3, capacity=32 * PAGE // 256, item_bytes=256)
    prompt = b.capacity - 8  # the last page holds 8 of its 16 items
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    def collections(call, *args) -> int:
        before = len(started)
        call(*args)
        return len(started) - before

    was_enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect()
    gc.enable()
    gc.set_threshold(700, 10, 10)
    gc.callbacks.append(count)
    try:
        grown = collections(b.prepare_write, [0], 0, prompt)  # 5,760 pages
        repeated = collections(b.reorder, [0] * 64)  # 11,520 sub-rows take row 0's pages
        assert b.table.row(b.rows * b.heads - 1).pages == b.table.row(b.heads - 1).pages  # row 63 holds row 0's
        b.prepare_write(range(64), prompt, prompt + 1)  # each sub-row copies the shared last page
        stepped = sum(collections(b.prepare_write, range(64), t, t + 1) for t in range(prompt + 1, b.capacity))
        cleared = collections(b.reorder, [0])  # rows 1..63 let go of their pages
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*thresholds)
        if not was_enabled:
            gc.disable()
    assert max(grown, repeated, stepped, cleared) <= 1, (grown, repeated, stepped, cleared)
    assert b.table.row(b.rows * b.heads - 1) == Row() and b.length(0) == b.capacity
    b.check_invariants()
    mapped_pages(b)
    b.close()
    assert arena.closed
