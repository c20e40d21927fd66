"""The no-holes rule on the CUDA backend (over the recording fake of ``fake_cuda.py``): in a
readable reservation (the static layout's), every page slot holds a real page or the scratch page
after any failure, also when the map, the access grant and the scratch refill of the rollback
fail; the buffer is intact or closed; :meth:`CudaBackend.reset` backs every slot again; and when
the buffer goes, every mapping and the range go back to the driver (a failed map whose own cleanup
unmap failed too left its first pages mapped and unrecorded, so the range could not be freed)."""

from __future__ import annotations

import gc
import warnings

import pytest
from fake_cuda import CUresult, fake_backend

from hf_vkv.memory import Arena, VirtualBuffer, VKVError


def backed(backend, buf: VirtualBuffer) -> None:
    """Every slot of ``buf``'s reservation holds a real page or the scratch page (no hole), and
    a real page exactly where the table says."""
    page = backend.page_bytes
    mapped, scratch = backend.mapped(), backend.scratch_addresses()
    for r, row in enumerate(buf.table):
        for slot in range(buf.pages_per_row):
            address = buf.address + r * buf.row_stride + slot * page
            assert address in mapped or address in scratch, f"hole at row {r} slot {slot}"
            if not buf.closed:
                want = row.pages[slot - row.start] if row.start <= slot < row.end else None
                assert mapped.get(address) == want, (r, slot)


def make():
    backend, cu = fake_backend(max_pages=64, create_ahead=64)  # every handle made up front: failures hit the mapping
    buf = VirtualBuffer(Arena(backend), rows=3, capacity=4 * 64, item_bytes=backend.page_bytes // 64, readable=True)
    buf.grow([0, 1], 70)
    buf.share(0, [2], length=64)
    return backend, cu, buf


def test_reset_backs_every_slot_with_the_scratch_page():
    backend, cu, buf = make()
    backend.reset(buf.address, buf.table.rows * buf.row_stride)
    assert not backend.mapped()
    assert len(backend.scratch_addresses()) == buf.table.rows * buf.pages_per_row


@pytest.mark.parametrize("op", ["grow", "reorder"])
def test_failed_maps_and_rollbacks_leave_no_hole(op):
    run = {"grow": lambda b: b.grow([0, 1, 2], 200), "reorder": lambda b: b.reorder([1, 0, 1])}[op]
    outcomes = set()
    for first in ("cuMemMap", "cuMemSetAccess", "cuMemUnmap"):
        for n in range(1, 7):
            for m in (None, 1, 2, 3):  # after a failing unmap, a failing map hits the release's remap
                backend, cu, buf = make()
                cu.fail(first, n, CUresult.CUDA_ERROR_OUT_OF_MEMORY)
                if m is not None:  # a second failure, in what follows: the rollback's calls
                    cu.fail("cuMemMap" if first != "cuMemMap" else "cuMemSetAccess", m)
                try:
                    run(buf)
                except VKVError as exc:
                    assert "\n" not in str(exc) and str(exc).count("failed") <= 2, str(exc)
                    outcomes.add("closed" if buf.closed else "intact")
                else:
                    outcomes.add("done")  # the failures fell after the operation's calls
                cu._faults.clear()
                if not buf.store.closed:  # a closed backend has given every mapping back
                    backed(backend, buf)
                if not buf.closed:
                    buf.check_invariants()
                    run(buf)  # still usable
                    backed(backend, buf)
                buf.close()
                with warnings.catch_warnings():
                    warnings.simplefilter("error")  # (a range that could not be given back warns)
                    del buf  # (its reservation goes with it)
                assert not cu.reservations and not cu.mappings, (first, n, m)  # everything went back to the driver
    assert {"intact", "done"} <= outcomes


def test_a_range_the_driver_cannot_free_at_a_buffers_end_is_said_in_one_warning():
    """A reservation is given back by a finalizer, where nothing can catch an error: a driver that
    refuses ``cuMemAddressFree`` (a sticky error) leaves one ``RuntimeWarning`` naming the range,
    which stays reserved (the backend keeps its record), instead of a traceback; the pages went
    back to the pool first."""
    backend, cu, buf = make()
    address, arena = buf.address, buf.store
    other = VirtualBuffer(arena, rows=1, capacity=64, item_bytes=backend.page_bytes // 64)  # the backend stays open
    buf.close()
    cu.fail("cuMemAddressFree", 1, CUresult.CUDA_ERROR_INVALID_VALUE)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del buf  # its reservation goes with it (or at the next collection)
        gc.collect()
    said = [w for w in caught if issubclass(w.category, RuntimeWarning) and "could not give back" in str(w.message)]
    assert len(said) == 1 and f"{address:#x}" in str(said[0].message), [str(w.message) for w in caught]
    assert "cuMemAddressFree" in str(said[0].message) and "stays reserved" in str(said[0].message)
    assert address in cu.reservations and not cu.pending()  # still reserved in the driver
    assert not any(arena.pool.refs.values())  # every page went back before the range
    other.close()
