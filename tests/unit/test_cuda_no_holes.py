"""The no-holes rule on the CUDA backend (over the recording fake of ``fake_cuda.py``): in a
readable reservation (the static layout's), every page slot holds a real page or the scratch page
after any failure, also when the map, the access grant and the scratch refill of the rollback
fail; the buffer is intact or closed; :meth:`CudaBackend.reset` backs every slot again."""

from __future__ import annotations

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
    assert {"intact", "done"} <= outcomes
