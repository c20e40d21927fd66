"""The driver's documented rules, as the strict fake of ``fake_cuda.py`` enforces them, and the
CUDA backend following them: a power-of-two reservation alignment, a current context on every
thread that calls the driver, the legacy stream for torch's stream 0, handle references.

The first tests check the fake itself (so that a backend breaking a rule fails on the CPU); the
others check the backend against it.
"""

from __future__ import annotations

import threading

import pytest
from fake_cuda import (LEGACY, PAGE, PRIMARY, CUresult, FakeCu, assert_nothing_held, fake_backend,
                       fake_hooks)

from hf_vkv.cuda import CU_STREAM_LEGACY, CudaBackend, CudaDriverError, Driver
from hf_vkv.memory import PageId


def _ready() -> FakeCu:
    cu = FakeCu()
    cu.cuInit(0)
    cu.make_current()
    return cu


# ------------------------------------------------------------------------------------ the fake's rules
def test_fake_reserve_wants_a_power_of_two_alignment() -> None:
    cu = _ready()
    assert cu.cuMemAddressReserve(6 * PAGE, 3 * PAGE, 0, 0)[0] == CUresult.CUDA_ERROR_INVALID_VALUE
    err, base = cu.cuMemAddressReserve(6 * PAGE, 2 * PAGE, 0, 0)
    assert err == 0 and base % (2 * PAGE) == 0
    assert cu.cuMemAddressReserve(PAGE, 0, 0, 0)[0] == 0  # 0: the driver's default


def test_fake_wants_a_current_context_on_the_calling_thread() -> None:
    cu = FakeCu()
    cu.cuInit(0)
    assert cu.cuMemCreate(PAGE, _prop(), 0)[0] == \
        CUresult.CUDA_ERROR_INVALID_CONTEXT
    cu.make_current()
    assert cu.cuMemCreate(PAGE, _prop(), 0)[0] == 0
    result: list = []
    thread = threading.Thread(target=lambda: result.append(cu.cuMemCreate(PAGE, _prop(), 0)[0]))
    thread.start()
    thread.join()
    assert result == [CUresult.CUDA_ERROR_INVALID_CONTEXT]  # current is per thread


def _prop():
    prop = FakeCu.CUmemAllocationProp()
    prop.type, prop.location.type, prop.location.id = "PINNED", "DEVICE", 0
    return prop


def test_fake_release_drops_a_reference_and_mapped_memory_stays_until_unmapped() -> None:
    cu = _ready()
    _, base = cu.cuMemAddressReserve(2 * PAGE, PAGE, 0, 0)
    _, h = cu.cuMemCreate(PAGE, _prop(), 0)
    assert cu.cuMemMap(base, PAGE, 0, h, 0) == (0,)
    assert cu.cuMemRelease(h) == (0,)
    assert h in cu.allocations and cu.mappings[base] == (PAGE, h)  # still mapped: memory kept
    assert cu.cuMemRelease(h) == (CUresult.CUDA_ERROR_INVALID_VALUE,)  # no reference left
    assert cu.cuMemMap(base + PAGE, PAGE, 0, h, 0) == (CUresult.CUDA_ERROR_INVALID_VALUE,)  # a dead handle
    assert cu.cuMemUnmap(base, PAGE) == (0,)
    assert h not in cu.allocations  # the last mapping took the memory with it


def test_fake_refuses_to_map_over_a_mapping_or_unmap_under_queued_work() -> None:
    cu = _ready()
    _, base = cu.cuMemAddressReserve(2 * PAGE, PAGE, 0, 0)
    _, a = cu.cuMemCreate(PAGE, _prop(), 0)
    _, b = cu.cuMemCreate(PAGE, _prop(), 0)
    cu.cuMemMap(base, PAGE, 0, a, 0)
    assert cu.cuMemMap(base, PAGE, 0, b, 0) == (CUresult.CUDA_ERROR_INVALID_VALUE,)
    cu.cuMemSetAccess(base, PAGE, [_access()], 1)
    cu.launch(base, PAGE)
    assert cu.cuMemUnmap(base, PAGE) == (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
    cu.synchronize()
    assert cu.cuMemUnmap(base, PAGE) == (0,)


def _access():
    desc = FakeCu.CUmemAccessDesc()
    desc.location.type, desc.location.id, desc.flags = "DEVICE", 0, "RW"
    return desc


def test_fake_stream_zero_is_the_per_thread_stream_in_per_thread_mode() -> None:
    assert FakeCu()._stream(0) == "legacy"
    assert FakeCu(per_thread_default_stream=True)._stream(0) == ("per-thread", threading.get_ident())
    assert FakeCu(per_thread_default_stream=True)._stream(LEGACY) == "legacy"


# ------------------------------------------------------------------------------------ the backend, fix 2
def test_a_page_that_is_not_a_power_of_two_reserves_with_a_power_of_two_alignment() -> None:
    """6 MiB-like pages (3 x the granularity): legal pages, but not a legal alignment."""
    cu = FakeCu()
    cu.make_current()
    backend = CudaBackend("cuda:0", page_bytes=3 * PAGE, max_pages=8, create_ahead=2,
                          driver=Driver(0, module=cu), hooks=fake_hooks(cu))
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    row = backend.reserve(4 * 3 * PAGE)
    assert [c[2] for c in cu.calls if c[0] == "cuMemAddressReserve"] == [PAGE, PAGE]
    backend.map(row + 3 * PAGE, [PageId(1), PageId(0)])
    assert set(backend.mapped()) == {row + 3 * PAGE, row + 6 * PAGE}
    backend.unmap(row, 4)
    backend.unreserve(row, 12 * PAGE)
    backend.close()
    assert_nothing_held(cu)


# ------------------------------------------------------------------------------------ fix 4
def test_driver_calls_from_a_thread_without_a_current_context() -> None:
    """A finalizer or a DLPack deleter may run on a thread that made no CUDA call: the backend
    still makes its calls there (the driver pushes the primary context and pops it after)."""
    backend, cu = fake_backend(create_ahead=2)
    backend.ensure_id_space(2)
    backend.create([PageId(0)])
    row = backend.reserve(2 * PAGE)
    backend.map(row, [PageId(0)])
    errors: list[BaseException] = []
    stacks: list[list[int]] = []

    def finalizer_thread() -> None:
        try:
            backend.unmap(row, 2)
            backend.unreserve(row, 2 * PAGE)
            backend.release([PageId(0)])
            backend.close()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)
        stacks.append(list(cu._stack()))

    thread = threading.Thread(target=finalizer_thread)
    thread.start()
    thread.join()
    assert errors == [] and stacks == [[]]  # and the thread's (empty) context stack is left as it was
    assert_nothing_held(cu)
    assert cu.primary_refs[0] == 1  # the driver's retain was released at the end; torch's stays


def test_a_thread_with_the_context_current_pushes_nothing() -> None:
    backend, cu = fake_backend()
    cu.clear_calls()
    backend.reserve(PAGE)
    assert "cuCtxPushCurrent" not in cu.names() and cu.names().count("cuCtxGetCurrent") == 1
    backend.close()


def test_a_closed_driver_refuses_calls() -> None:
    cu = FakeCu()
    drv = Driver(0, module=cu)
    drv.close()
    drv.close()  # idempotent
    assert cu.primary_refs[0] == 0
    with pytest.raises(CudaDriverError, match="closed"):
        drv.create(PAGE)


# ------------------------------------------------------------------------------------ fix 5
@pytest.mark.parametrize("per_thread", [False, True])
def test_copies_on_torch_stream_zero_run_on_the_legacy_stream(per_thread: bool) -> None:
    backend, cu = fake_backend(cu=FakeCu(per_thread_default_stream=per_thread), stream=0)
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    backend.copy([(PageId(0), PageId(1))])
    assert cu.copies[-1][3] == "legacy" and cu.calls[-1][-1] == CU_STREAM_LEGACY
    backend.close()
    assert_nothing_held(cu)


def test_other_streams_are_passed_as_they_are() -> None:
    backend, cu = fake_backend(stream=0xBEEF)
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    backend.copy([(PageId(1), PageId(0))])
    assert cu.copies[-1][3] == 0xBEEF
    backend.close()


def test_primary_context_handle_is_what_the_driver_pushes() -> None:
    cu = FakeCu()
    drv = Driver(0, module=cu)
    drv.create(PAGE)  # nothing current on this thread: pushed and popped around the call
    names = cu.names()
    assert names[-3:] == ["cuCtxPushCurrent", "cuMemCreate", "cuCtxPopCurrent"]
    assert ("cuCtxPushCurrent", PRIMARY) in cu.calls and cu._stack() == []
