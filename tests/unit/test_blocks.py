"""BlockBuffer / BlockStore: the paged translator, as executable specs with exact block ids.

Geometry: 16-byte items, blocks of 4 items (64 bytes), a store in 4 KiB host pages. Bytes are
read back through :meth:`BlockStore.blocks` and the block tables, the way a paged kernel reads
them; after every operation the page table's and pools' invariants must hold.
"""

from __future__ import annotations

import gc

import pytest
import torch

from hf_vkv.memory import (
    Arena,
    BlockBuffer,
    BlockStore,
    CacheClosedError,
    HostBackend,
    KVCacheOutOfMemory,
    PageId,
    Row,
)

ITEM, BLOCK_ITEMS, CAP = 16, 4, 40
BLOCK = ITEM * BLOCK_ITEMS
P = PageId


@pytest.fixture
def new():
    """``new(rows=3, budget_bytes=None, max_blocks=64)`` makes a block buffer on a fresh store."""
    made: list[BlockBuffer] = []

    def make(rows: int = 3, *, budget_bytes: int | None = None, max_blocks: int = 64) -> BlockBuffer:
        arena = Arena(HostBackend(page_bytes=4096), budget_bytes=budget_bytes)
        store = BlockStore(arena, block_bytes=BLOCK, max_blocks=max_blocks)
        buf = BlockBuffer(store, rows=rows, capacity=CAP, item_bytes=ITEM)
        made.append(buf)
        return buf

    yield make
    for buf in made:
        buf.close()


def write(buf: BlockBuffer, row: int, start: int, end: int, seed: int) -> torch.Tensor:
    """prepare_write, then write random bytes to items ``[start, end)`` of ``row`` through the
    block table; return them ``[end - start, ITEM]``."""
    buf.prepare_write([row], start, end)
    data = torch.randint(0, 256, (end - start, ITEM), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    items = buf.store.blocks().view(-1, ITEM)  # [blocks * BLOCK_ITEMS, ITEM]
    table = buf.block_tables(range(buf.rows)).long()
    for k, t in enumerate(range(start, end)):
        items[table[row, t // BLOCK_ITEMS] * BLOCK_ITEMS + t % BLOCK_ITEMS] = data[k]
    return data


def read(buf: BlockBuffer, row: int, start: int, end: int) -> torch.Tensor:
    items = buf.store.blocks().view(-1, ITEM)
    table = buf.block_tables(range(buf.rows)).long()
    return torch.stack([items[table[row, t // BLOCK_ITEMS] * BLOCK_ITEMS + t % BLOCK_ITEMS] for t in range(start, end)])


def test_ids_are_dense_and_the_store_grows_to_the_highest(new):
    buf = new()
    buf.grow([0], 6)  # 2 blocks
    buf.grow([1], 9)  # 3 blocks
    assert buf.table.row(0) == Row(6 * ITEM, 0, (P(0), P(1)))
    assert buf.table.row(1) == Row(9 * ITEM, 0, (P(2), P(3), P(4)))
    assert buf.store.num_blocks == 5
    assert buf.block_tables(range(3)).tolist() == [[0, 1, 0], [2, 3, 4], [0, 0, 0]]
    buf.clear([0])
    buf.grow([2], 4)  # recycles a freed block before taking a fresh id
    assert buf.table.row(2).pages == (P(0),)
    assert buf.store.num_blocks == 5
    buf.check_invariants()


def test_writes_read_back_through_block_tables(new):
    buf = new()
    data = write(buf, 1, 0, 11, seed=1)
    assert torch.equal(read(buf, 1, 0, 11), data)
    assert buf.length(1) == 11 and buf.length(0) == 0


def test_share_then_copy_on_write_copies_one_block(new):
    buf = new()
    prompt = write(buf, 0, 0, 6, seed=2)  # blocks 0 (full) and 1 (half)
    buf.share(0, [1, 2])
    assert buf.table.row(1).pages == buf.table.row(0).pages
    assert buf.stats().distinct_pages == 2 and buf.stats().shared_pages == 2
    tail = write(buf, 2, 6, 7, seed=3)  # row 2 writes into the shared half block: copy-on-write
    assert buf.table.cow_copies == 1
    assert buf.table.row(2).pages[0] == buf.table.row(0).pages[0]  # the full block stays shared
    assert buf.table.row(2).pages[1] not in buf.table.row(0).pages
    assert torch.equal(read(buf, 2, 0, 6), prompt)  # the copy carried the shared tokens
    assert torch.equal(read(buf, 2, 6, 7), tail)
    assert torch.equal(read(buf, 0, 0, 6), prompt)  # the source did not change
    buf.check_invariants()


def test_reorder_moves_references_only(new):
    buf = new()
    a, b = write(buf, 0, 0, 5, seed=4), write(buf, 1, 0, 5, seed=5)
    store_bytes = buf.store.blocks().clone()
    buf.reorder([1, 1, 0])
    assert torch.equal(buf.store.blocks(), store_bytes)  # no byte moved
    assert torch.equal(read(buf, 0, 0, 5), b) and torch.equal(read(buf, 1, 0, 5), b)
    assert torch.equal(read(buf, 2, 0, 5), a)
    buf.check_invariants()


def test_drop_before_frees_blocks_behind_a_window_and_tables_keep_positions(new):
    buf = new()
    data = write(buf, 0, 0, 14, seed=6)  # blocks for items 0-3, 4-7, 8-11, 12-13
    buf.drop_before([0], 9)  # blocks wholly before item 9: the first two
    row = buf.table.row(0)
    assert row.start == 2 and len(row.pages) == 2
    assert buf.first_live(0) == 8
    assert buf.block_tables(range(1))[0, :2].tolist() == [0, 0]  # dropped entries are never read
    assert torch.equal(read(buf, 0, 8, 14), data[8:])
    assert buf.store.pool.stats().in_use == 2
    buf.check_invariants()


def test_fork_shares_the_store_and_closing_returns_blocks(new):
    buf = new()
    data = write(buf, 0, 0, 7, seed=7)
    twin = buf.fork()
    assert twin.store is buf.store and twin.table.row(0).pages == buf.table.row(0).pages
    write(twin, 0, 7, 8, seed=8)  # copy-on-write in the fork only
    assert torch.equal(read(buf, 0, 0, 7), data) and buf.length(0) == 7
    twin.close()
    assert buf.store.pool.stats().in_use == 2
    buf.close()
    assert buf.store.closed and buf.store.pool.stats().in_use == 0
    with pytest.raises(CacheClosedError):
        buf.grow([0], 1)


def test_a_dropped_buffer_returns_its_blocks():
    arena = Arena(HostBackend(page_bytes=4096))
    store = BlockStore(arena, block_bytes=BLOCK, max_blocks=16)
    keep = BlockBuffer(store, rows=1, capacity=CAP, item_bytes=ITEM)
    gone = BlockBuffer(store, rows=2, capacity=CAP, item_bytes=ITEM)
    gone.grow([0, 1], 8)
    assert store.pool.stats().in_use == 4
    del gone
    gc.collect()
    assert store.pool.stats().in_use == 0 and not store.closed
    keep.close()
    assert store.closed and arena.closed


def test_budget_of_the_arena_bounds_the_store_and_nothing_changes_on_oom(new):
    buf = new(rows=8, budget_bytes=4096, max_blocks=128)  # one host page of the store: 64 blocks
    buf.grow(range(6), CAP)  # 60 blocks fit in it
    with pytest.raises(KVCacheOutOfMemory):
        buf.grow([6, 7], CAP)  # 80 blocks need a second host page
    assert buf.table.row(6) == Row() and buf.table.row(7) == Row()
    assert buf.store.pool.stats().in_use == 60 and buf.store.num_blocks == 60
    buf.grow([6], 12)  # still usable: 3 more blocks fit
    buf.check_invariants()


def test_store_capacity_bounds_blocks_with_a_typed_error(new):
    buf = new(max_blocks=5)
    buf.grow([0], 20)  # 5 blocks
    with pytest.raises(KVCacheOutOfMemory):
        buf.grow([1], 1)
    assert buf.table.row(1) == Row() and buf.store.pool.stats().in_use == 5
    buf.check_invariants()


def test_blocks_must_hold_whole_items():
    arena = Arena(HostBackend(page_bytes=4096))
    store = BlockStore(arena, block_bytes=BLOCK, max_blocks=4)
    with pytest.raises(ValueError, match="whole items"):
        BlockBuffer(store, rows=1, capacity=CAP, item_bytes=24)
    with pytest.raises(ValueError, match="must be positive"):
        BlockStore(arena, block_bytes=0, max_blocks=4)
    keep = BlockBuffer(store, rows=1, capacity=CAP, item_bytes=ITEM)  # the failed one left the store usable
    keep.close()
    assert arena.closed
