"""Sharing a prefix's device pages across processes, on a CPU, over the strict fake of
``cuda.bindings.driver`` (``fake_cuda.py``): two backends on one fake stand for two processes on
one device. One exports pages (``cuMemExportToShareableHandle``, POSIX file descriptors), the
descriptors travel through a real Unix socket pair (``SCM_RIGHTS``), the other imports them
(``cuMemImportFromShareableHandle``) and maps them; the fake says both map the same allocation,
memory goes only when every handle and descriptor is gone, errors are typed. Also the host to
device page write. ``tests/gpu/test_gpu_share.py`` does the same across two real processes."""

from __future__ import annotations

import os
import socket

import pytest
import torch
from fake_cuda import PAGE, CUresult, FakeCu, assert_nothing_held, fake_backend, fake_hooks, vmm_names

from hf_vkv.cuda import CudaBackend, CudaDriverError, Driver, PageSharingError, recv_page_fds, send_page_fds
from hf_vkv.cuda.vmm_backend import _HEADER, FDS_PER_MESSAGE
from hf_vkv.memory import BackendError, KVCacheOutOfMemory, PageId


def _peer(cu: FakeCu, *, shareable: bool = True, max_pages: int = 64) -> CudaBackend:
    """A second backend on the same fake (another process on the same device); torch's context
    is already current on this thread."""
    return CudaBackend("cuda:0", create_ahead=1, max_pages=max_pages, driver=Driver(0, module=cu, shareable=shareable),
                       hooks=fake_hooks(cu), shareable=shareable)


def _pages(n: int) -> list[PageId]:
    return [PageId(i) for i in range(n)]


@pytest.fixture
def pair():
    """(exporter, importer, fake): the exporter holds pages 0..2, written with known bytes."""
    exporter, cu = fake_backend(create_ahead=1, shareable=True)
    importer = _peer(cu)
    exporter.ensure_id_space(8)
    importer.ensure_id_space(8)
    exporter.create(_pages(3))
    data = torch.arange(3 * PAGE, dtype=torch.int64).remainder(251).to(torch.uint8).view(3, PAGE)
    exporter.write_pages(_pages(3), data)
    yield exporter, importer, cu, data
    for b in (importer, exporter):
        b.close()
    assert_nothing_held(cu)


def _through_socket(fds: list[int], page_bytes: int) -> tuple[list[int], int]:
    a, b = socket.socketpair()
    try:
        send_page_fds(a, fds, page_bytes=page_bytes)
        return recv_page_fds(b)
    finally:
        a.close()
        b.close()


def _close(fds) -> None:
    for fd in fds:
        os.close(fd)


# ------------------------------------------------------------------------------------ the share
def test_export_send_import_map_reads_the_exporters_bytes_from_one_allocation(pair) -> None:
    exporter, importer, cu, data = pair
    used = cu.used_bytes()
    fds = exporter.export_pages(_pages(3))
    assert len(set(fds)) == 3 and vmm_names(cu).count("cuMemExportToShareableHandle") == 3
    received, page_bytes = _through_socket(fds, exporter.page_bytes)
    assert page_bytes == PAGE and set(received).isdisjoint(fds)  # the receiver's own descriptors
    _close(fds)  # the sender's copies: the received ones keep the memory
    importer.import_pages([PageId(5), PageId(6), PageId(7)], received, page_bytes=page_bytes)
    _close(received)  # the imported handles keep it now
    assert cu.open_exports() == []
    assert cu.used_bytes() == used  # one copy: importing created no memory
    assert importer.imported_pages == 3 and importer.resident_bytes() == 0
    assert [importer.is_imported(PageId(p)) for p in (5, 6, 7)] == [True] * 3
    assert not exporter.is_imported(PageId(0))
    # both map the pages into their rows; the fake says the same allocations sit behind both
    mine = exporter.reserve(3 * PAGE)
    theirs = importer.reserve(4 * PAGE)
    exporter.map(mine, _pages(3))
    importer.map(theirs + PAGE, [PageId(5), PageId(6), PageId(7)])
    for k in range(3):
        assert cu.memory_at(mine + k * PAGE) is cu.memory_at(theirs + (k + 1) * PAGE)
        assert cu.allocations[importer.handle(PageId(5 + k))].memory is cu.memory_at(mine + k * PAGE)
        assert importer.handle(PageId(5 + k)) != exporter.handle(PageId(k))  # a new handle, same memory
        assert cu.read(theirs + (k + 1) * PAGE, PAGE) == bytes(data[k].numpy())
    importer.unmap(theirs, 4)
    exporter.unmap(mine, 3)
    importer.unreserve(theirs, 4 * PAGE)
    exporter.unreserve(mine, 3 * PAGE)


def test_many_descriptors_travel_in_several_messages() -> None:
    """More descriptors than one SCM_RIGHTS message takes (Linux: 253) arrive in order."""
    n = FDS_PER_MESSAGE + 7
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(n)]
    try:
        inodes = [os.fstat(fd).st_ino for fd in fds]
        a, b = socket.socketpair()
        with a, b:
            send_page_fds(a, fds, page_bytes=PAGE)
            got, page_bytes = recv_page_fds(b)
        assert page_bytes == PAGE and len(got) == n
        assert [os.fstat(fd).st_ino for fd in got] == inodes
        _close(got)
    finally:
        _close(fds)
    a, b = socket.socketpair()
    with a, b:
        send_page_fds(a, [], page_bytes=PAGE)
        assert recv_page_fds(b) == ([], PAGE)


def test_recv_closes_what_arrived_when_the_peer_stops_early() -> None:
    fds = [os.open(os.devnull, os.O_RDONLY) for _ in range(FDS_PER_MESSAGE)]
    before = set(os.listdir("/proc/self/fd"))
    a, b = socket.socketpair()
    with b:
        with a:
            # announce two messages' worth, send only the first
            socket.send_fds(a, [_HEADER.pack(FDS_PER_MESSAGE + 1, PAGE, FDS_PER_MESSAGE)], fds)
        with pytest.raises(PageSharingError, match="closed the socket after 250"):
            recv_page_fds(b)
    _close(fds)
    assert set(os.listdir("/proc/self/fd")) <= before  # the received descriptors were closed


# ------------------------------------------------------------------------------------ lifetimes
@pytest.mark.parametrize("order", ["importer-first", "exporter-first"])
def test_memory_goes_only_when_every_handle_is_released_and_unmapped(pair, order) -> None:
    exporter, importer, cu, data = pair
    fds = exporter.export_pages([PageId(0)])
    importer.import_pages([PageId(1)], fds)
    _close(fds)
    memory = cu.memory_at(importer._slot_address(importer._slot_of[PageId(1)]))
    row = importer.reserve(PAGE)
    importer.map(row, [PageId(1)])
    if order == "importer-first":
        importer.unmap(row, 1)
        importer.release([PageId(1)])  # the imported handle only
        assert memory in cu.memories() and exporter.handle(PageId(0)) in cu.handles
        assert importer.imported_pages == 0
        exporter.release([PageId(0)])
        assert memory not in cu.memories()
    else:
        exporter.release([PageId(0)])  # the exporter lets go first: the importer's handle holds it
        assert memory in cu.memories()
        assert cu.read(row, PAGE) == bytes(data[0].numpy())  # still mapped, still the bytes
        importer.unmap(row, 1)
        assert memory in cu.memories()  # the window mapping and the handle
        importer.release([PageId(1)])
        assert memory not in cu.memories()
    importer.unreserve(row, PAGE)


def test_an_open_descriptor_keeps_the_memory_until_closed(pair) -> None:
    exporter, importer, cu, _ = pair
    fds = exporter.export_pages([PageId(2)])
    memory = cu.memory_at(exporter._slot_address(exporter._slot_of[PageId(2)]))
    exporter.release([PageId(2)])
    assert memory in cu.memories() and cu.open_exports() == fds  # only the descriptor holds it
    importer.import_pages([PageId(0)], fds)  # and it can still be imported
    _close(fds)
    assert memory in cu.memories()
    importer.release([PageId(0)])
    assert memory not in cu.memories()


def test_closing_the_importer_releases_imported_handles_and_leaves_the_exporter(pair) -> None:
    exporter, importer, cu, data = pair
    fds = exporter.export_pages(_pages(3))
    importer.import_pages(_pages(3), fds)
    _close(fds)
    row = importer.reserve(3 * PAGE)
    importer.map(row, _pages(3))
    held = exporter.resident_bytes()
    importer.unmap(row, 3)
    importer.unreserve(row, 3 * PAGE)
    importer.close()
    assert exporter.resident_bytes() == held and cu.used_bytes() == 3 * PAGE
    mine = exporter.reserve(PAGE)
    exporter.map(mine, [PageId(1)])
    assert cu.read(mine, PAGE) == bytes(data[1].numpy())
    exporter.unmap(mine, 1)
    exporter.unreserve(mine, PAGE)


def test_an_imported_page_is_never_written_but_is_copied_from(pair) -> None:
    exporter, importer, cu, _ = pair
    fds = exporter.export_pages([PageId(0)])
    importer.import_pages([PageId(0)], fds)
    _close(fds)
    importer.create([PageId(1)])
    with pytest.raises(PageSharingError, match="never writes"):
        importer.write_pages([PageId(0)], torch.zeros(1, PAGE, dtype=torch.uint8))
    with pytest.raises(PageSharingError, match="never writes"):
        importer.copy([(PageId(1), PageId(0))])
    importer.copy([(PageId(0), PageId(1))])  # copy-on-write: the imported page is the source
    assert cu.copies[-1][:3] == (importer._slot_address(importer._slot_of[PageId(1)]),
                                 importer._slot_address(importer._slot_of[PageId(0)]), PAGE)
    with pytest.raises(PageSharingError, match="export it from the process that created it"):
        importer.export_pages([PageId(0)])


def test_imported_pages_reuse_emptied_window_slots_and_count_against_max_pages() -> None:
    exporter, cu = fake_backend(create_ahead=1, shareable=True)
    importer = _peer(cu, max_pages=2)
    exporter.ensure_id_space(4)
    importer.ensure_id_space(4)
    exporter.create(_pages(3))
    importer.create([PageId(0)])
    fds = exporter.export_pages(_pages(3))
    with pytest.raises(KVCacheOutOfMemory, match="window slots"):
        importer.import_pages([PageId(1), PageId(2)], fds[:2])
    importer.release([PageId(0)])
    importer.import_pages([PageId(1), PageId(2)], fds[:2])
    assert sorted(importer._slot_of.values()) == [0, 1]
    _close(fds)
    importer.close()
    exporter.close()
    assert_nothing_held(cu)


# ------------------------------------------------------------------------------------ errors
def test_sharing_needs_shareable_backends() -> None:
    plain, cu = fake_backend(create_ahead=1)
    plain.ensure_id_space(2)
    plain.create([PageId(0)])
    assert not plain.shareable
    with pytest.raises(PageSharingError, match="without shareable handles") as info:
        plain.export_pages([PageId(0)])
    assert isinstance(info.value, BackendError) and info.value.call == "cuMemExportToShareableHandle"
    fd = os.open(os.devnull, os.O_RDONLY)
    try:
        with pytest.raises(PageSharingError, match="without shareable handles"):
            plain.import_pages([PageId(1)], [fd])
    finally:
        os.close(fd)
    assert "cuMemExportToShareableHandle" not in vmm_names(cu)
    assert "cuMemImportFromShareableHandle" not in vmm_names(cu)
    plain.close()
    assert_nothing_held(cu)


def test_a_shareable_backend_requests_the_posix_fd_handle_type_and_a_plain_one_none() -> None:
    shared, cu = fake_backend(create_ahead=1, shareable=True)
    assert shared._driver._prop.requestedHandleTypes == "POSIX_FD"
    assert ("cuDeviceGetAttribute", "POSIX_FD_SUPPORTED", 0) in cu.calls
    plain = _peer(cu, shareable=False)
    assert plain._driver._prop.requestedHandleTypes == "NONE"
    # the driver refuses to export what was created without the handle type
    plain.ensure_id_space(1)
    plain.create([PageId(0)])
    err, fd = cu.cuMemExportToShareableHandle(plain.handle(PageId(0)), "POSIX_FD", 0)
    assert err == CUresult.CUDA_ERROR_NOT_SUPPORTED and fd is None
    mismatched = Driver(0, module=cu)
    with pytest.raises(ValueError, match="shareable"):
        CudaBackend("cuda:0", max_pages=4, driver=mismatched, hooks=fake_hooks(cu), shareable=True)
    mismatched.close()  # refused: still the caller's
    plain.close()
    shared.close()
    assert_nothing_held(cu)


def test_a_device_without_posix_fd_handles_is_refused_up_front() -> None:
    cu = FakeCu(posix_fd_supported=False)
    cu.make_current()
    with pytest.raises(PageSharingError, match="does not support POSIX file descriptor handles"):
        Driver(0, module=cu, shareable=True)
    assert cu.primary_refs[0] == 1  # the retain given back (torch's remains)
    Driver(0, module=cu).close()  # a plain driver is fine


def test_exporting_a_page_without_memory_is_typed_and_leaks_no_descriptor(pair) -> None:
    exporter, _, cu, _ = pair
    with pytest.raises(PageSharingError, match="page 5 has no physical memory"):
        exporter.export_pages([PageId(0), PageId(5)])
    assert cu.open_exports() == [] and "cuMemExportToShareableHandle" not in vmm_names(cu)
    cu.fail("cuMemExportToShareableHandle", 2, CUresult.CUDA_ERROR_OUT_OF_MEMORY)
    with pytest.raises(CudaDriverError, match="OUT_OF_MEMORY"):
        exporter.export_pages(_pages(3))
    assert cu.open_exports() == []  # the first descriptor was closed again


def test_bad_descriptors_are_typed_and_import_is_all_or_nothing(pair) -> None:
    exporter, importer, cu, _ = pair
    fds = exporter.export_pages(_pages(2))
    closed = os.open(os.devnull, os.O_RDONLY)
    os.close(closed)
    with pytest.raises(PageSharingError, match=f"file descriptor {closed} is not open"):
        importer.import_pages([PageId(0), PageId(1)], [fds[0], closed])
    with pytest.raises(PageSharingError, match="is not a file descriptor"):
        importer.import_pages([PageId(0)], [-1])
    with pytest.raises(PageSharingError, match="same page_bytes"):
        importer.import_pages([PageId(0)], fds[:1], page_bytes=2 * PAGE)
    with pytest.raises(ValueError, match="one file descriptor per page"):
        importer.import_pages([PageId(0)], fds)
    with pytest.raises(BackendError, match="outside the id space"):
        importer.import_pages([PageId(99)], fds[:1])
    names = len(cu.calls)
    stranger = os.open(os.devnull, os.O_RDONLY)  # open, but no export
    try:
        with pytest.raises(PageSharingError, match=f"file descriptor {stranger} does not name") as info:
            importer.import_pages([PageId(0), PageId(1)], [fds[0], stranger])
        assert isinstance(info.value.__cause__, CudaDriverError)
    finally:
        os.close(stranger)
    # the first page had been imported and mapped at its window slot: all undone
    assert [c[0] for c in cu.calls[names:] if c[0].startswith("cuMem")] == [
        "cuMemImportFromShareableHandle", "cuMemMap", "cuMemImportFromShareableHandle", "cuMemUnmap", "cuMemRelease"]
    assert importer._slot_of == {} and importer.imported_pages == 0
    assert len(cu.handles) == 3  # the exporter's three pages only
    # a failing map of an imported handle is undone as well
    cu.fail("cuMemMap", 2, CUresult.CUDA_ERROR_INVALID_VALUE)
    with pytest.raises(PageSharingError, match="cannot be mapped as a page"):
        importer.import_pages([PageId(0), PageId(1)], fds)
    assert importer._slot_of == {} and len(cu.handles) == 3
    importer.import_pages([PageId(0), PageId(1)], fds)  # the slots are still usable
    _close(fds)
    importer.release([PageId(0), PageId(1)])


# ------------------------------------------------------------------------------------ host -> device
def test_write_pages_copies_each_row_into_its_page_on_torchs_stream_then_waits() -> None:
    backend, cu = fake_backend(create_ahead=1)  # a plain backend writes too
    backend.ensure_id_space(4)
    backend.create(_pages(3))
    data = torch.randint(0, 256, (2, PAGE), dtype=torch.uint8)
    cu.clear_calls()
    backend.write_pages([PageId(2), PageId(0)], data)
    slot = backend._slot_of
    assert [c[0] for c in cu.host_copies] == [backend._slot_address(slot[PageId(2)]),
                                              backend._slot_address(slot[PageId(0)])]
    assert [c[1] - data.data_ptr() for c in cu.host_copies] == [0, PAGE]
    assert {c[3] for c in cu.host_copies} == {0x5EED} and vmm_names(cu)[-1] == "synchronize"
    assert vmm_names(cu).count("synchronize") == 1
    row = backend.reserve(2 * PAGE)
    backend.map(row, [PageId(0), PageId(2)])
    assert cu.read(row, PAGE) == bytes(data[1].numpy()) and cu.read(row + PAGE, PAGE) == bytes(data[0].numpy())
    assert cu.read(row, 0) == b""
    assert backend.counters()["pages_written"] == 2
    # a strided view is made contiguous first
    strided = torch.randint(0, 256, (PAGE, 1), dtype=torch.uint8).t()
    backend.write_pages([PageId(1)], strided)
    backend.unmap(row, 2)
    backend.map(row, [PageId(1)])
    assert cu.read(row, PAGE) == bytes(strided[0].numpy())
    backend.unmap(row, 1)
    backend.unreserve(row, 2 * PAGE)
    backend.close()
    assert_nothing_held(cu)


def test_write_pages_checks_its_arguments_and_waits_even_when_a_copy_fails() -> None:
    backend, cu = fake_backend(create_ahead=1)
    backend.ensure_id_space(4)
    backend.create(_pages(2))
    good = torch.zeros(2, PAGE, dtype=torch.uint8)
    for bad in (torch.zeros(2, PAGE, dtype=torch.int16), torch.zeros(1, PAGE, dtype=torch.uint8),
                torch.zeros(2, PAGE - 1, dtype=torch.uint8), torch.zeros(2, PAGE, dtype=torch.uint8, device="meta"),
                bytes(2 * PAGE)):
        with pytest.raises(ValueError, match="uint8 CPU tensor"):
            backend.write_pages(_pages(2), bad)
    with pytest.raises(BackendError, match="page 3 has no physical memory"):
        backend.write_pages([PageId(0), PageId(3)], good)
    with pytest.raises(BackendError, match="duplicate"):
        backend.write_pages([PageId(0), PageId(0)], good)
    assert cu.host_copies == []
    backend.write_pages([], torch.zeros(0, PAGE, dtype=torch.uint8))
    cu.clear_calls()
    cu.fail("cuMemcpyHtoDAsync", 2, CUresult.CUDA_ERROR_ILLEGAL_ADDRESS)
    with pytest.raises(CudaDriverError, match="ILLEGAL_ADDRESS"):
        backend.write_pages(_pages(2), good)
    assert vmm_names(cu) == ["cuMemcpyHtoDAsync", "cuMemcpyHtoDAsync", "synchronize"]
    backend.close()
    assert_nothing_held(cu)


def test_read_pages_gives_back_what_write_pages_wrote_also_through_an_import(pair) -> None:
    exporter, importer, cu, data = pair
    assert torch.equal(exporter.read_pages([PageId(2), PageId(0)]), data[[2, 0]])
    fds = exporter.export_pages([PageId(1)])
    importer.import_pages([PageId(4)], fds)
    _close(fds)
    assert torch.equal(importer.read_pages([PageId(4)]), data[1:2])  # an imported page is read
    assert vmm_names(cu)[-2:] == ["cuMemcpyDtoHAsync", "synchronize"]
    assert importer.read_pages([]).shape == (0, PAGE)
    with pytest.raises(BackendError, match="page 7 has no physical memory"):
        importer.read_pages([PageId(7)])
    exporter.create([PageId(3)])
    assert torch.equal(exporter.read_pages([PageId(3)]), torch.zeros(1, PAGE, dtype=torch.uint8))
