"""The CUDA backend's logic on a CPU, over the strict recording fake of ``cuda.bindings.driver``
in ``fake_cuda.py`` (it refuses what the real driver documents as invalid, records every call,
and can be told to fail the n-th call of a function with a given ``CUresult``). The tests assert exact call orders, error translation, and that a failing call in
the middle of an operation leaves nothing mapped and nothing leaked, also under a
:class:`VirtualBuffer`. None of this replaces ``tests/gpu`` (the real driver on a GPU).
"""

from __future__ import annotations

import random
import sys

import pytest
import torch
from fake_cuda import (MIN_GRAN, PAGE, REC_GRAN, STREAM, CUresult, FakeCu, assert_nothing_held, fake_backend, vmm_calls,
                       vmm_names)

from hf_vkv.devices import UnsupportedDeviceError, arena_for_device, default_cuda_budget
from hf_vkv.cuda import CudaBackend, CudaDriverError, CudaUnavailableError, Driver, check, load_bindings
from hf_vkv.memory import Arena, BackendError, KVCacheOutOfMemory, PageId, VirtualBuffer

# ------------------------------------------------------------------------------------ error translation
def test_check_returns_outputs_and_raises_naming_the_call_and_error() -> None:
    cu = FakeCu()
    assert check("cuMemUnmap", (CUresult.CUDA_SUCCESS,), module=cu) is None
    assert check("cuMemCreate", (CUresult.CUDA_SUCCESS, 7), module=cu) == 7
    assert check("x", (CUresult.CUDA_SUCCESS, 1, 2), module=cu) == (1, 2)
    with pytest.raises(CudaDriverError) as info:
        check("cuMemCreate", (CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), module=cu)
    err = info.value
    assert isinstance(err, BackendError)
    assert (err.call, err.result, err.code) == ("cuMemCreate", "CUDA_ERROR_OUT_OF_MEMORY", 2)
    assert str(err) == "cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY (2): out of memory"
    with pytest.raises(BackendError, match="unexpected return value"):
        check("cuMemMap", None, module=cu)


def test_check_without_a_driver_still_names_the_error() -> None:
    class NoDriver(FakeCu):
        def cuGetErrorString(self, err):  # noqa: N802
            raise RuntimeError("Failed to dlopen libcuda.so.1")

    with pytest.raises(CudaDriverError, match=r"cuMemMap failed: CUDA_ERROR_INVALID_VALUE \(1\): no description"):
        check("cuMemMap", (CUresult.CUDA_ERROR_INVALID_VALUE,), module=NoDriver())


def test_every_driver_method_translates_its_failure() -> None:
    cu = FakeCu()
    drv = Driver(0, module=cu)
    cases = {
        "cuMemGetAllocationGranularity": drv.granularity,
        "cuMemAddressReserve": lambda: drv.reserve(PAGE, PAGE),
        "cuMemAddressFree": lambda: drv.address_free(1, PAGE),
        "cuMemCreate": lambda: drv.create(PAGE),
        "cuMemRelease": lambda: drv.release(1),
        "cuMemMap": lambda: drv.map(1, PAGE, 1),
        "cuMemSetAccess": lambda: drv.set_access(1, PAGE),
        "cuMemUnmap": lambda: drv.unmap(1, PAGE),
        "cuMemcpyDtoDAsync": lambda: drv.copy_async(1, 2, PAGE, 0),
    }
    for name, call in cases.items():
        cu.fail(name, error=CUresult.CUDA_ERROR_NOT_SUPPORTED)
        with pytest.raises(CudaDriverError, match=f"^{name} failed: CUDA_ERROR_NOT_SUPPORTED") as info:
            call()
        assert info.value.call == name
    assert not cu.pending()


def test_driver_builds_pinned_device_properties() -> None:
    drv = Driver(0, module=FakeCu())
    assert drv.granularity() == REC_GRAN  # the larger of minimum and recommended
    prop = drv._prop
    assert (prop.type, prop.requestedHandleTypes, prop.location.type, prop.location.id) == (
        "PINNED", "NONE", "DEVICE", 0)
    (access,) = drv._access
    assert (access.location.type, access.location.id, access.flags) == ("DEVICE", 0, "RW")


def test_driver_against_the_real_bindings_without_a_gpu() -> None:
    """The real ``cuda.bindings`` (when installed): the enum and struct names the driver layer uses
    exist, results are named without a driver, and a missing driver library is a clear error."""
    drv_module = pytest.importorskip("cuda.bindings.driver")
    with pytest.raises(CudaDriverError, match="cuMemCreate failed: CUDA_ERROR_OUT_OF_MEMORY"):
        check("cuMemCreate", (drv_module.CUresult.CUDA_ERROR_OUT_OF_MEMORY, None), module=drv_module)

    class Initialized:  # the real module, but cuInit succeeds (no driver on this machine)
        def __getattr__(self, name):
            return getattr(drv_module, name)

        def cuInit(self, flags):  # noqa: N802
            return (drv_module.CUresult.CUDA_SUCCESS,)

        def cuDeviceGet(self, ordinal):  # noqa: N802
            return drv_module.CUresult.CUDA_SUCCESS, drv_module.CUdevice(ordinal)

        def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
            return drv_module.CUresult.CUDA_SUCCESS, drv_module.CUcontext()

    drv = Driver(3, module=Initialized())
    assert drv._prop.location.id == 3 and drv._access[0].location.id == 3
    assert drv._prop.type == drv_module.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    assert drv._access[0].flags == drv_module.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    if torch.cuda.is_available():
        return
    with pytest.raises(CudaUnavailableError, match="libcuda"):
        Driver(0, module=drv_module)


# ------------------------------------------------------------------------------------ missing pieces
def test_missing_cuda_bindings_names_the_extra(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "cuda.bindings.driver", None)  # import now raises ImportError
    with pytest.raises(CudaUnavailableError, match=r"pip install 'hf_vkv\[cuda\]'") as info:
        load_bindings()
    assert isinstance(info.value, ImportError)
    with pytest.raises(CudaUnavailableError, match=r"hf_vkv\[cuda\]"):
        arena_for_device(torch.device("cuda", 0), page_bytes=None, budget_bytes=None)


def test_other_devices_are_refused_and_cpu_keeps_the_host_backend() -> None:
    with pytest.raises(UnsupportedDeviceError, match=r"only the host \(CPU\) and CUDA devices"):
        arena_for_device(torch.device("meta"), page_bytes=None, budget_bytes=None)
    arena = arena_for_device(torch.device("cpu"), page_bytes=8192, budget_bytes=None)
    assert type(arena.backend).__name__ == "HostBackend" and arena.page_bytes == 8192
    arena.backend.close()


def test_default_cuda_budget_leaves_a_margin() -> None:
    gib = 1 << 30
    assert default_cuda_budget(70 * gib, 80 * gib) == 70 * gib - 4 * gib  # 5% of 80 GiB
    assert default_cuda_budget(10 * gib, 16 * gib) == 9 * gib  # at least 1 GiB


@pytest.mark.slow  # a fresh interpreter: 13-23 s on a loaded 2-core machine
# ------------------------------------------------------------------------------------ call order
def test_construction_queries_granularity_and_reserves_the_window() -> None:
    backend, cu = fake_backend(max_pages=10)
    assert backend.page_bytes == PAGE
    assert vmm_calls(cu) == [("cuInit", 0), ("cuDeviceGet", 0), ("cuDevicePrimaryCtxRetain", 0),
                             ("cuMemGetAllocationGranularity", "MIN"),
                        ("cuMemGetAllocationGranularity", "REC"), ("cuMemAddressReserve", 10 * PAGE, PAGE, 0, 0)]
    backend.close()
    assert_nothing_held(cu)


def test_page_bytes_must_be_a_multiple_of_the_granularity() -> None:
    with pytest.raises(ValueError, match="multiple of the device's allocation granularity"):
        CudaBackend("cuda:0", page_bytes=PAGE + MIN_GRAN, driver=Driver(0, module=FakeCu()),
                    hooks=fake_backend()[0]._hooks)
    with pytest.raises(ValueError, match="create_ahead"):
        CudaBackend("cuda:0", create_ahead=0, driver=Driver(0, module=FakeCu()), hooks=fake_backend()[0]._hooks)


def test_create_makes_handles_ahead_in_batches() -> None:
    backend, cu = fake_backend(create_ahead=3)
    window = backend._window
    backend.ensure_id_space(10)
    cu.clear_calls()
    backend.create([PageId(5)])
    assert vmm_calls(cu) == [
        ("cuMemCreate", PAGE, 0), ("cuMemMap", window, PAGE, 0, 1, 0),
        ("cuMemCreate", PAGE, 0), ("cuMemMap", window + PAGE, PAGE, 0, 2, 0),
        ("cuMemCreate", PAGE, 0), ("cuMemMap", window + 2 * PAGE, PAGE, 0, 3, 0),
        ("cuMemSetAccess", window, 3 * PAGE),
    ]
    assert backend.spare_pages == 2 and backend.resident_bytes() == 3 * PAGE
    cu.clear_calls()
    backend.create([PageId(6), PageId(7)])
    assert vmm_calls(cu) == []  # served by the spares
    backend.create([PageId(8), PageId(9)])  # 2 needed, 0 spare: a batch of max(2, 3)
    assert vmm_names(cu) == ["cuMemCreate", "cuMemMap"] * 3 + ["cuMemSetAccess"]
    assert backend.spare_pages == 1 and backend.resident_bytes() == 6 * PAGE
    assert len({backend.handle(PageId(p)) for p in (5, 6, 7, 8, 9)}) == 5
    backend.close()
    assert_nothing_held(cu)


def test_create_checks_ids_and_the_page_limit() -> None:
    backend, cu = fake_backend(create_ahead=4, max_pages=3)
    backend.ensure_id_space(8)
    with pytest.raises(BackendError, match="outside the id space"):
        backend.create([PageId(8)])
    cu.clear_calls()
    with pytest.raises(KVCacheOutOfMemory, match="device pages need"):
        backend.create([PageId(0), PageId(1), PageId(2), PageId(3)])
    assert vmm_calls(cu) == [] and backend.resident_bytes() == 0
    backend.create([PageId(0)])  # the batch is capped by max_pages
    assert backend.resident_bytes() == 3 * PAGE and backend.spare_pages == 2
    with pytest.raises(BackendError, match="already has physical memory"):
        backend.create([PageId(0)])
    backend.close()
    assert_nothing_held(cu)


def test_map_is_one_map_per_page_then_one_set_access_and_unmap_synchronizes_first() -> None:
    backend, cu = fake_backend()
    backend.ensure_id_space(4)
    backend.create([PageId(0), PageId(1), PageId(2)])
    row = backend.reserve(8 * PAGE)
    h = [backend.handle(PageId(p)) for p in range(3)]
    cu.clear_calls()
    backend.map(row + PAGE, [PageId(2), PageId(0), PageId(2)])  # aliasing: one page twice
    assert vmm_calls(cu) == [("cuMemMap", row + PAGE, PAGE, 0, h[2], 0), ("cuMemMap", row + 2 * PAGE, PAGE, 0, h[0], 0),
                        ("cuMemMap", row + 3 * PAGE, PAGE, 0, h[2], 0), ("cuMemSetAccess", row + PAGE, 3 * PAGE)]
    assert backend.mapped() == {row + PAGE: 2, row + 2 * PAGE: 0, row + 3 * PAGE: 2}
    cu.launch(row + PAGE, 3 * PAGE)  # a kernel still reads the row: the unmap must wait for it
    cu.clear_calls()
    backend.unmap(row + 2 * PAGE, 2)
    assert vmm_calls(cu) == [("synchronize",), ("cuMemUnmap", row + 2 * PAGE, 2 * PAGE)]
    assert backend.mapped() == {row + PAGE: 2}
    backend.unmap(row, 0)  # nothing to do: no synchronize either
    assert vmm_calls(cu)[-1] == ("cuMemUnmap", row + 2 * PAGE, 2 * PAGE)
    cu.clear_calls()
    backend.unmap(row, 8)  # only what is mapped: slot 1; nothing queued since: no synchronize
    assert vmm_calls(cu) == [("cuMemUnmap", row + PAGE, PAGE)] and ("stream_idle",) in cu.calls
    cu.clear_calls()
    backend.unmap(row, 8)  # nothing mapped: no call at all
    backend.unreserve(row, 8 * PAGE)
    assert vmm_calls(cu) == [("cuMemAddressFree", row, 8 * PAGE)]
    backend.close()
    assert_nothing_held(cu)


def test_map_over_a_mapped_slot_unmaps_it_first() -> None:
    backend, cu = fake_backend()
    backend.ensure_id_space(3)
    backend.create([PageId(0), PageId(1), PageId(2)])
    row = backend.reserve(4 * PAGE)
    backend.map(row, [PageId(0), PageId(1)])
    cu.clear_calls()
    backend.map(row + PAGE, [PageId(2), PageId(0)])  # slot 1 held page 1, slot 2 was empty
    h = backend.handle
    assert vmm_calls(cu) == [("cuMemUnmap", row + PAGE, PAGE),
                        ("cuMemMap", row + PAGE, PAGE, 0, h(PageId(2)), 0),
                        ("cuMemMap", row + 2 * PAGE, PAGE, 0, h(PageId(0)), 0),
                        ("cuMemSetAccess", row + PAGE, 2 * PAGE)]
    assert backend.mapped() == {row: 0, row + PAGE: 2, row + 2 * PAGE: 0}
    backend.unmap(row, 4)
    cu.clear_calls()
    backend.unreserve(row, 4 * PAGE)
    assert vmm_calls(cu) == [("cuMemAddressFree", row, 4 * PAGE)]
    backend.close()
    assert_nothing_held(cu)


def test_map_of_a_page_without_memory_is_refused_before_any_call() -> None:
    backend, cu = fake_backend()
    backend.ensure_id_space(2)
    row = backend.reserve(2 * PAGE)
    cu.clear_calls()
    with pytest.raises(BackendError, match="page 1 has no physical memory"):
        backend.map(row, [PageId(1)])
    assert vmm_calls(cu) == []
    backend.unreserve(row, 2 * PAGE)
    backend.close()
    assert_nothing_held(cu)


def test_copy_queues_window_to_window_copies_on_the_current_stream() -> None:
    backend, cu = fake_backend(create_ahead=2)
    backend.ensure_id_space(4)
    backend.create([PageId(3), PageId(1)])
    src, dst = (backend._window + backend._slot_of[PageId(p)] * PAGE for p in (3, 1))
    cu.clear_calls()
    backend.copy([(PageId(3), PageId(1))])
    assert vmm_calls(cu) == [("cuMemcpyDtoDAsync", dst, src, PAGE, STREAM)]
    with pytest.raises(BackendError, match="page 0 has no physical memory"):
        backend.copy([(PageId(0), PageId(1))])
    backend.close()
    assert_nothing_held(cu)


def test_release_unmaps_the_window_slot_and_releases_the_handle() -> None:
    backend, cu = fake_backend(create_ahead=2)
    backend.ensure_id_space(4)
    backend.create([PageId(0), PageId(1)])
    slot, handle = backend._slot_of[PageId(1)], backend.handle(PageId(1))
    cu.clear_calls()
    backend.release([PageId(1)])
    assert vmm_calls(cu) == [("cuMemUnmap", backend._window + slot * PAGE, PAGE),
                        ("cuMemRelease", handle)]
    assert backend.resident_bytes() == PAGE and handle not in cu.handles
    backend.create([PageId(2)])  # the freed slot is used again
    assert backend._slot_of[PageId(2)] == slot
    with pytest.raises(BackendError, match="no physical memory"):
        backend.release([PageId(1)])
    backend.close()
    assert_nothing_held(cu)


def test_close_frees_everything_even_pages_still_mapped_in_rows() -> None:
    backend, cu = fake_backend(create_ahead=3)
    backend.ensure_id_space(4)
    backend.create([PageId(0), PageId(1)])
    row = backend.reserve(4 * PAGE)
    backend.map(row, [PageId(0), PageId(1)])
    cu.clear_calls()
    backend.close()
    names = vmm_names(cu)
    assert names[0] == "synchronize" and names.count("cuMemRelease") == 3 and names[-1] == "cuMemAddressFree"
    assert cu.handles == {} and cu.mappings == {} and list(cu.reservations) == [row]
    backend.close()  # idempotent
    backend.unreserve(row, 4 * PAGE)  # row reservations go when their owners give them back
    assert_nothing_held(cu)
    with pytest.raises(Exception, match="closed"):
        backend.create([PageId(2)])


# ------------------------------------------------------------------------------------ rollback
@pytest.mark.parametrize("failing", [1, 2, 3])
def test_a_failing_map_in_a_run_unmaps_what_it_mapped(failing: int) -> None:
    backend, cu = fake_backend()
    backend.ensure_id_space(3)
    backend.create([PageId(0), PageId(1), PageId(2)])
    row = backend.reserve(4 * PAGE)
    before = dict(cu.mappings)
    cu.clear_calls()
    cu.fail("cuMemMap", failing)
    with pytest.raises(CudaDriverError, match="cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY"):
        backend.map(row, [PageId(0), PageId(1), PageId(2)])
    expected = [("cuMemMap", row + k * PAGE, PAGE, 0, backend.handle(PageId(k)), 0) for k in range(failing)]
    if failing > 1:
        expected.append(("cuMemUnmap", row, (failing - 1) * PAGE))
    assert vmm_calls(cu) == expected
    assert cu.mappings == before and backend.mapped() == {}
    backend.map(row, [PageId(0), PageId(1), PageId(2)])  # usable afterwards
    assert len(cu.mappings) == len(before) + 3
    backend.unmap(row, 3)
    backend.unreserve(row, 4 * PAGE)
    backend.close()
    assert_nothing_held(cu)


def test_a_failing_set_access_unmaps_the_whole_run() -> None:
    backend, cu = fake_backend()
    backend.ensure_id_space(2)
    backend.create([PageId(0), PageId(1)])
    row = backend.reserve(2 * PAGE)
    before = dict(cu.mappings)
    cu.clear_calls()
    cu.fail("cuMemSetAccess")
    with pytest.raises(CudaDriverError, match="cuMemSetAccess failed"):
        backend.map(row, [PageId(1), PageId(0)])
    assert vmm_names(cu) == ["cuMemMap", "cuMemMap", "cuMemSetAccess", "cuMemUnmap"]
    assert vmm_calls(cu)[-1] == ("cuMemUnmap", row, 2 * PAGE)
    assert cu.mappings == before and backend.mapped() == {}
    backend.unreserve(row, 2 * PAGE)
    backend.close()
    assert_nothing_held(cu)


@pytest.mark.parametrize("call,nth", [("cuMemCreate", 1), ("cuMemCreate", 3), ("cuMemMap", 2), ("cuMemSetAccess", 1)])
def test_a_failing_batch_create_releases_the_whole_batch(call: str, nth: int) -> None:
    backend, cu = fake_backend(create_ahead=3)
    backend.ensure_id_space(4)
    backend.create([PageId(0)])
    backend.create([PageId(1), PageId(2)])  # spares used up
    held = dict(cu.handles), dict(cu.mappings)
    state = backend.resident_bytes(), backend.spare_pages
    cu.fail(call, nth, CUresult.CUDA_ERROR_NOT_SUPPORTED)  # out of memory is retried: see test_cuda_memory.py
    with pytest.raises(CudaDriverError, match=f"{call} failed"):
        backend.create([PageId(3)])
    assert (dict(cu.handles), dict(cu.mappings)) == held
    assert (backend.resident_bytes(), backend.spare_pages) == state
    backend.create([PageId(3)])  # usable afterwards, in the same slots
    assert backend._slot_of[PageId(3)] == 3
    backend.close()
    assert_nothing_held(cu)


def test_a_failing_release_keeps_the_page_usable() -> None:
    backend, cu = fake_backend(create_ahead=1)
    backend.ensure_id_space(2)
    backend.create([PageId(0)])
    cu.fail("cuMemRelease")
    with pytest.raises(CudaDriverError, match="cuMemRelease failed"):
        backend.release([PageId(0)])
    assert backend.resident_bytes() == PAGE and backend._window in cu.accessible  # mapped back
    backend.copy([(PageId(0), PageId(0))])
    backend.release([PageId(0)])
    backend.close()
    assert_nothing_held(cu)


def test_unreserve_refuses_an_unknown_range() -> None:
    backend, cu = fake_backend()
    row = backend.reserve(2 * PAGE)
    with pytest.raises(BackendError, match="no reservation"):
        backend.unreserve(row, PAGE)
    backend.unreserve(row, 2 * PAGE)
    backend.close()
    assert_nothing_held(cu)


def test_close_frees_everything_when_a_finalizer_gives_a_reservation_back_meanwhile() -> None:
    """``close()`` iterated the reservations while its waits could run a collection whose
    finalizer (a row buffer's view left in a cycle) gave one back: 'dictionary changed size during
    iteration', with every handle, the window and the context still held."""
    import gc
    import weakref

    from fake_cuda import fake_hooks
    from hf_vkv.cuda import TorchHooks

    cu = FakeCu()
    base = fake_hooks(cu)

    def idle_after_a_collection() -> bool:
        gc.collect()
        return base.stream_idle()

    hooks = TorchHooks(synchronize=base.synchronize, stream=base.stream, stream_idle=idle_after_a_collection,
                       tensor=base.tensor, total_bytes=base.total_bytes, free_bytes=base.free_bytes)
    cu.make_current()
    backend = CudaBackend("cuda:0", create_ahead=4, max_pages=64, driver=Driver(0, module=cu), hooks=hooks)
    backend.ensure_id_space(4)
    backend.create([PageId(0), PageId(1)])
    kept = backend.reserve(2 * PAGE, readable=True)
    given = backend.reserve(2 * PAGE, readable=True)

    class Owner:
        pass

    owner = Owner()
    owner.cycle = owner  # freed by a collection only
    weakref.finalize(owner, backend.unreserve, given, 2 * PAGE)
    del owner
    backend.close()
    assert cu.handles == {} and list(cu.reservations) == [kept]
    backend.unreserve(kept, 2 * PAGE)
    assert_nothing_held(cu)


def test_a_driver_or_backend_that_fails_as_it_is_made_holds_no_context(monkeypatch: pytest.MonkeyPatch) -> None:
    """The primary context retained first was kept when a later step failed: a failing
    ``cuDeviceGetAttribute`` of a shareable Driver, or a backend that made its own Driver and then
    refused its page size or could not reserve its window."""
    import hf_vkv.cuda.vmm_backend as vmm_backend
    from fake_cuda import fake_hooks

    cu = FakeCu()
    cu.make_current()
    cu.fail("cuDeviceGetAttribute", 1, CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(CudaDriverError, match="cuDeviceGetAttribute"):
        Driver(0, module=cu, shareable=True)
    assert_nothing_held(cu)  # torch's retain alone
    made = vmm_backend.Driver
    monkeypatch.setattr(vmm_backend, "Driver", lambda index, shareable=False: made(index, module=cu, shareable=shareable))
    with pytest.raises(ValueError, match="multiple of the device's"):
        CudaBackend("cuda:0", page_bytes=PAGE + 4096, hooks=fake_hooks(cu))
    cu.fail("cuMemAddressReserve", 1)
    with pytest.raises(BackendError, match="cuMemAddressReserve"):
        CudaBackend("cuda:0", hooks=fake_hooks(cu))
    assert_nothing_held(cu)
    CudaBackend("cuda:0", hooks=fake_hooks(cu)).close()  # and one that does not fail gives its context back too
    assert_nothing_held(cu)


def test_a_block_inside_another_devices_block_runs_under_its_own_context() -> None:
    """A ``current()`` block inside one of another device's (a finalizer of one backend running
    in another's call), itself inside one of its own device's, skipped the driver's check as a
    nested block and ran its calls under the other device's context."""
    from fake_cuda import PRIMARY

    cu = FakeCu()
    cu.make_current(0)
    a, b = Driver(0, module=cu), Driver(1, module=cu)
    seen = []
    with a.current():
        seen.append(cu._stack()[-1] - PRIMARY)
        with b.current():
            seen.append(cu._stack()[-1] - PRIMARY)
            with a.current():
                seen.append(cu._stack()[-1] - PRIMARY)
                with a.current():  # directly inside its own: no driver call
                    before = len(cu.calls)
                    seen.append(cu._stack()[-1] - PRIMARY)
                    assert len(cu.calls) == before
            seen.append(cu._stack()[-1] - PRIMARY)
        seen.append(cu._stack()[-1] - PRIMARY)
    assert seen == [0, 1, 0, 0, 1, 0]
    assert cu._stack() == [PRIMARY]
    a.close()
    b.close()


# ------------------------------------------------------------------------------------ under a VirtualBuffer
def _driver_rows(buf: VirtualBuffer, backend: CudaBackend, cu: FakeCu) -> dict[tuple[int, int], int]:
    """What the fake driver maps in ``buf``'s reservation: ``{(row, slot): handle}``."""
    lo, hi = buf.address, buf.address + buf.rows * buf.row_stride
    out = {}
    for address, (size, handle) in cu.mappings.items():
        if lo <= address < hi:
            assert size == PAGE and address in cu.accessible
            out[((address - lo) // buf.row_stride, (address - lo) % buf.row_stride // PAGE)] = handle
    return out


def _table_rows(buf: VirtualBuffer, backend: CudaBackend) -> dict[tuple[int, int], int]:
    return {(r, row.start + k): backend.handle(p) for r, row in enumerate(buf.table) for k, p in enumerate(row.pages)}


def _state(buf: VirtualBuffer, backend: CudaBackend, cu: FakeCu) -> tuple:
    pool = buf.store.pool
    return (tuple(buf.table), pool.stats(), {p: pool.refcount(p) for p in pool.in_use_pages()},
            _driver_rows(buf, backend, cu),
            # pages' handles (create-ahead spares may stay behind: they are the backend's, not the buffer's)
            backend.resident_bytes() - backend.spare_pages * PAGE, len(cu.handles) - backend.spare_pages)


def test_buffer_operations_roll_back_on_any_failing_driver_call() -> None:
    """Random operations on a VirtualBuffer over the CUDA backend, a driver call failing now and
    then: each operation either succeeds, or raises and leaves the table, the pool, the driver's
    mappings and the handles exactly as they were. The driver always maps what the table says."""
    rng = random.Random(1234)
    backend, cu = fake_backend(create_ahead=2, max_pages=40)
    arena = Arena(backend, budget_bytes=30 * PAGE)
    item = 4096  # 32 items a page
    rows, capacity = 4, 5 * 32 - 7
    buf = VirtualBuffer(arena, rows=rows, capacity=capacity, item_bytes=item)
    failures = successes = 0
    calls = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemcpyDtoDAsync")
    failed_calls: dict[str, int] = {}
    for step in range(2500):
        some = rng.sample(range(rows), rng.randint(1, rows))
        n = rng.randint(0, capacity)
        op = rng.choice(["grow", "write", "share", "reorder", "truncate", "clear", "drop"])
        if op == "grow":
            run = lambda: buf.grow(some, n)  # noqa: E731
        elif op == "write":
            start = max(0, n - rng.randint(0, 40))
            if any(start * item // PAGE < buf.table.row(r).start for r in some):
                continue
            run = lambda: buf.prepare_write(some, start, n)  # noqa: E731
        elif op == "share":
            src = rng.randrange(rows)
            run = lambda: buf.share(src, some)  # noqa: E731
        elif op == "reorder":
            run = lambda: buf.reorder([rng.randrange(rows) for _ in range(rows)])  # noqa: E731
        elif op == "truncate":
            run = lambda: buf.truncate(some, n)  # noqa: E731
        elif op == "drop":
            run = lambda: buf.drop_before(some, n)  # noqa: E731
        else:
            run = lambda: buf.clear(some)  # noqa: E731
        armed = rng.random() < 0.4
        if armed:
            cu.fail(rng.choice(calls), rng.randint(1, 3), CUresult.CUDA_ERROR_NOT_SUPPORTED)
        before = _state(buf, backend, cu)
        try:
            run()
        except CudaDriverError as exc:
            assert armed
            failures += 1
            failed_calls[exc.call] = failed_calls.get(exc.call, 0) + 1
            assert _state(buf, backend, cu) == before, f"step {step}: {op} left traces"
        except (KVCacheOutOfMemory, ValueError):  # over budget; sharing pages dropped behind a window
            assert _state(buf, backend, cu) == before
        else:
            successes += 1
        cu._faults.clear()
        buf.check_invariants()
        assert _driver_rows(buf, backend, cu) == _table_rows(buf, backend), f"step {step} after {op}"
        if rng.random() < 0.05:
            arena.trim()
            assert backend.resident_bytes() <= arena.pool.stats().resident_bytes + backend.spare_pages * PAGE
    assert failures > 150 and successes > 1000, (failures, successes)
    assert all(failed_calls.get(c, 0) >= 5 for c in calls), failed_calls  # every kind of call failed
    buf.close()
    del buf
    import gc

    gc.collect()  # the reservation goes with its last reference
    assert arena.closed
    assert_nothing_held(cu)


def test_copy_on_write_copies_through_the_window_before_the_row_is_remapped() -> None:
    backend, cu = fake_backend(create_ahead=4)
    arena = Arena(backend)
    buf = VirtualBuffer(arena, rows=2, capacity=64, item_bytes=4096)  # 32 items a page
    buf.grow([0], 40)
    buf.share(0, [1])
    shared = buf.table.row(0).pages[1]
    cu.clear_calls()
    buf.prepare_write([1], 39, 41)  # the second page is shared: row 1 gets a copy
    new = buf.table.row(1).pages[1]
    assert new != shared and buf.table.row(0).pages[1] == shared
    names = vmm_names(cu)
    copy_at = names.index("cuMemcpyDtoDAsync")
    assert names[copy_at:] == ["cuMemcpyDtoDAsync", "synchronize", "cuMemUnmap", "cuMemMap", "cuMemSetAccess"]
    slot = backend._slot_of
    assert vmm_calls(cu)[copy_at][1:3] == (backend._window + slot[new] * PAGE, backend._window + slot[shared] * PAGE)
    assert _driver_rows(buf, backend, cu) == _table_rows(buf, backend)
    buf.close()
    del buf
    import gc

    gc.collect()
    assert_nothing_held(cu)
