"""The CUDA backend's memory behaviour over the strict fake driver: device out-of-memory as a
typed error with the cache intact, one wait per transaction and only changed pages remapped on a
beam reorder, and readable reservations (the scratch page of the compileable static layout)."""

from __future__ import annotations

import gc

import pytest
from fake_cuda import PAGE, CUresult, FakeCu, assert_nothing_held, fake_backend, vmm_calls, vmm_names

from hf_vkv.cuda import CudaDriverError
from hf_vkv.memory import Arena, KVCacheOutOfMemory, PageId, VirtualBuffer

ITEM = 4096  # 32 items a page


def _delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def _rows_state(buf: VirtualBuffer, cu: FakeCu) -> tuple:
    lo, hi = buf.address, buf.address + buf.rows * buf.row_stride
    return tuple(buf.table), {a: h for a, (_, h) in cu.mappings.items() if lo <= a < hi}


# ------------------------------------------------------------------------------------ fix 3
def test_device_out_of_memory_retries_with_the_missing_pages_then_is_a_typed_error() -> None:
    """The device holds 5 pages (torch's allocator took the rest after the budget was read):
    a create-ahead batch of 16 fails, the 2 missing pages alone fit; past the device's memory
    the error is KVCacheOutOfMemory and the buffer is exactly as it was, and usable."""
    cu = FakeCu(device_bytes=5 * PAGE)
    backend, cu = fake_backend(create_ahead=16, max_pages=64, cu=cu)
    buf = VirtualBuffer(Arena(backend), rows=2, capacity=8 * 32, item_bytes=ITEM)
    buf.grow([0], 2 * 32)  # two pages: the batch of 16 fails, then exactly 2 are made
    assert buf.length(0) == 64 and backend.counters()["create_retries"] == 1
    assert backend.resident_bytes() == 2 * PAGE and backend.spare_pages == 0
    before = _rows_state(buf, cu), buf.store.pool.stats()
    with pytest.raises(KVCacheOutOfMemory, match="device page") as info:
        buf.grow([1], 4 * 32)  # four more pages: only three left on the device
    assert info.value.requested_bytes == 4 * PAGE and info.value.free_bytes == 3 * PAGE
    assert isinstance(info.value.__cause__, CudaDriverError)
    del info  # its traceback holds the buffer's frames
    assert (_rows_state(buf, cu), buf.store.pool.stats()) == before and buf.length(1) == 0
    buf.grow([1], 3 * 32)  # what fits still works
    assert buf.length(1) == 96
    buf.check_invariants()
    buf.close()
    del buf
    gc.collect()  # the reservation goes with its last reference
    assert_nothing_held(cu)


def test_other_driver_errors_are_not_retried() -> None:
    backend, cu = fake_backend(create_ahead=8)
    backend.ensure_id_space(2)
    cu.fail("cuMemCreate", 2, CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(CudaDriverError, match="CUDA_ERROR_NOT_SUPPORTED"):
        backend.create([PageId(0)])
    assert vmm_names(cu).count("cuMemCreate") == 2 and backend.resident_bytes() == 0
    backend.close()
    assert_nothing_held(cu)


# ------------------------------------------------------------------------------------ fix 6
def _beam_buffer(rows: int = 4, pages: int = 3) -> tuple[VirtualBuffer, object, FakeCu]:
    backend, cu = fake_backend(create_ahead=4, max_pages=64)
    buf = VirtualBuffer(Arena(backend), rows=rows, capacity=4 * 32, item_bytes=ITEM)
    buf.grow([0], pages * 32)
    for r in range(1, rows):  # beams start from one prompt, then diverge: own pages per row
        buf.grow([r], pages * 32)
    return buf, backend, cu


def test_a_beam_reorder_waits_once_and_remaps_only_the_rows_that_changed() -> None:
    buf, backend, cu = _beam_buffer()
    for r in range(buf.rows):  # attention of this step still runs
        cu.launch(buf.address + r * buf.row_stride, 3 * PAGE)
    before = backend.counters()
    buf.reorder([0, 0, 2, 3])  # beams 2 and 3 continue their own history; beam 1 takes beam 0's
    d = _delta(backend.counters(), before)
    assert d["pages_unmapped"] == 3 and d["pages_mapped"] == 3 and d["unmap_runs"] == 1
    assert d["synchronizes"] == 1
    buf.check_invariants()
    cu.launch(buf.address, PAGE)
    cu.clear_calls()
    buf.reorder([2, 3, 0, 1])  # every row changes: 4 rows x 3 pages, still one wait
    assert vmm_names(cu).count("synchronize") == 1 and vmm_names(cu).count("cuMemUnmap") == 4
    assert vmm_names(cu).count("cuMemSetAccess") == 4  # one per row run
    buf.check_invariants()
    buf.close()
    del buf
    gc.collect()  # the reservation goes with its last reference
    assert_nothing_held(cu)


def test_a_reorder_that_changes_nothing_calls_nothing() -> None:
    buf, backend, cu = _beam_buffer()
    cu.clear_calls()
    buf.reorder([0, 1, 2, 3])
    assert vmm_calls(cu) == []
    buf.close()
    del buf
    gc.collect()  # the reservation goes with its last reference
    assert_nothing_held(cu)


# ------------------------------------------------------------------------------------ readable reservations
def _scratch_state(backend, cu: FakeCu, base: int, slots: int) -> list[object]:
    """What the driver maps at each slot: "S" for the scratch page, a page id, or None."""
    by_handle = {backend.handle(p): int(p) for p in backend._slot_of}
    out: list[object] = []
    for k in range(slots):
        m = cu.mappings.get(base + k * PAGE)
        out.append(None if m is None else "S" if m[1] == backend._scratch else by_handle[m[1]])
        assert m is None or base + k * PAGE in cu.accessible
    return out


def test_a_readable_reservation_holds_the_scratch_page_wherever_no_page_is_mapped() -> None:
    backend, cu = fake_backend(create_ahead=2)
    backend.ensure_id_space(4)
    backend.create([PageId(0), PageId(1)])
    cu.clear_calls()
    base = backend.reserve(4 * PAGE, readable=True)
    scratch = backend._scratch
    assert vmm_calls(cu) == [("cuMemAddressReserve", 4 * PAGE, PAGE, 0, 0), ("cuMemCreate", PAGE, 0),
                             *[("cuMemMap", base + k * PAGE, PAGE, 0, scratch, 0) for k in range(4)],
                             ("cuMemSetAccess", base, 4 * PAGE)]
    assert _scratch_state(backend, cu, base, 4) == ["S"] * 4
    assert backend.resident_bytes() == 3 * PAGE  # two pages and the scratch
    cu.launch(base, 4 * PAGE)  # a captured graph reads the whole capacity
    cu.clear_calls()
    backend.map(base + PAGE, [PageId(1), PageId(0)])
    assert vmm_calls(cu) == [("synchronize",), ("cuMemUnmap", base + PAGE, 2 * PAGE),
                             ("cuMemMap", base + PAGE, PAGE, 0, backend.handle(PageId(1)), 0),
                             ("cuMemMap", base + 2 * PAGE, PAGE, 0, backend.handle(PageId(0)), 0),
                             ("cuMemSetAccess", base + PAGE, 2 * PAGE)]
    assert _scratch_state(backend, cu, base, 4) == ["S", 1, 0, "S"]
    assert backend.counters()["pages_mapped"] == 2
    other = backend.reserve(2 * PAGE, readable=True)  # the same scratch page
    assert backend._scratch == scratch and backend.resident_bytes() == 3 * PAGE
    backend.unmap(base + 2 * PAGE, 2)  # page 0 goes, the scratch comes back; slot 3 untouched
    assert _scratch_state(backend, cu, base, 4) == ["S", 1, "S", "S"]
    cu.clear_calls()
    backend.unreserve(base, 4 * PAGE)  # one unmap over the whole (fully mapped) range
    assert vmm_calls(cu) == [("cuMemUnmap", base, 4 * PAGE), ("cuMemAddressFree", base, 4 * PAGE)]
    backend.close()
    backend.unreserve(other, 2 * PAGE)
    assert_nothing_held(cu)


@pytest.mark.parametrize("call,nth", [("cuMemMap", 2), ("cuMemSetAccess", 1)])
def test_a_failing_map_in_a_readable_reservation_puts_the_scratch_back(call: str, nth: int) -> None:
    backend, cu = fake_backend(create_ahead=2)
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    base = backend.reserve(3 * PAGE, readable=True)
    cu.fail(call, nth, CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(CudaDriverError, match=call):
        backend.map(base, [PageId(0), PageId(1)])
    assert _scratch_state(backend, cu, base, 3) == ["S", "S", "S"] and backend.mapped() == {}
    backend.map(base, [PageId(0), PageId(1)])
    assert _scratch_state(backend, cu, base, 3) == [0, 1, "S"]
    backend.unmap(base, 3)
    backend.unreserve(base, 3 * PAGE)
    backend.close()
    assert_nothing_held(cu)


def test_a_failing_scratch_fill_gives_the_reservation_back() -> None:
    backend, cu = fake_backend()
    cu.fail("cuMemMap", 3, CUresult.CUDA_ERROR_NOT_SUPPORTED)
    with pytest.raises(CudaDriverError, match="cuMemMap"):
        backend.reserve(4 * PAGE, readable=True)
    assert len(cu.reservations) == 1 and cu.mappings == {}  # the window only
    backend.close()
    assert_nothing_held(cu)


def test_no_device_memory_for_the_scratch_page_is_a_typed_error() -> None:
    backend, cu = fake_backend(cu=FakeCu(device_bytes=PAGE // 2))
    with pytest.raises(KVCacheOutOfMemory, match="scratch page"):
        backend.reserve(2 * PAGE, readable=True)
    assert len(cu.reservations) == 1  # the window only
    backend.close()
    assert_nothing_held(cu)
