"""The CUDA backend: physical pages are ``cuMemCreate`` allocations mapped into reserved device
virtual memory with ``cuMemMap`` (the vAttention approach), behind the
:class:`~hf_vkv.memory.backend_protocol.Backend` protocol.

* **Pages and handles.** Page id ``p`` is backed by one allocation handle of ``page_bytes`` (the
  driver maps whole allocations only: one handle per page). Creating a handle is the slow call
  (30-200 µs a 2 MiB page on an A100), so handles are created ahead in batches of
  ``create_ahead`` and kept as *spares* until a page needs one. When the device is out of memory
  the batch is retried with exactly the missing handles, and if those do not fit either,
  :class:`~hf_vkv.memory.errors.KVCacheOutOfMemory` is raised with nothing changed.
* **The window.** Every handle is also mapped once, at creation, into a backend-owned reservation
  (slot ``k`` at ``window + k * page_bytes``). Copy-on-write copies a page to a page that is not
  mapped in any row yet; the window gives both an address. It costs virtual address space only.
* **Map a run** = ``cuMemMap`` per page (one handle per page: no fewer calls are possible), then
  one ``cuMemSetAccess`` over the run. If a call fails part way, the pages mapped so far are
  unmapped again. The driver cannot map over a mapping, so slots that hold another page (a beam
  reorder, a copy-on-write swap) are unmapped first, whole runs per call.
* **Waiting before an unmap.** A kernel still reading a range that is unmapped faults the context
  (Xid 31). Before unmapping, the backend asks whether torch's current stream is idle (an event
  query, which never blocks) and synchronizes the device only if it is not. After that wait no
  kernel is queued until the caller launches one, so the other unmaps of the same transaction
  (every row of a beam reorder) find the stream idle: one synchronize per transaction, without
  a protocol hook. This relies on torch's stream contract: work on other streams that reads the
  cache is ordered before the current stream (``wait_stream``) by whoever launched it.
* **Readable reservations** (``reserve(readable=True)``, for the compileable static layout): one
  *scratch* page, created once per backend, is mapped at every page slot that holds no real page,
  so any address of the reservation can be read (and written, harmlessly) by a captured graph.
  ``map`` unmaps the scratch at its slots first, ``unmap`` puts the scratch back.
* **Release** unmaps a page from the window (after the same wait: a copy may still use it) and
  releases its handle; the memory goes back to the driver at once (an imported page's memory
  goes once the exporter and every importer have released it).
* **Sharing pages across processes** (``shareable=True``): allocations are created exportable as
  POSIX file descriptors. :meth:`CudaBackend.export_pages` gives one fd per page
  (``cuMemExportToShareableHandle``); :func:`send_page_fds` / :func:`recv_page_fds` pass them over
  a Unix socket (``SCM_RIGHTS``); :meth:`CudaBackend.import_pages` backs page ids of the importing
  backend with them (``cuMemImportFromShareableHandle``, mapped at a window slot like a created
  page), after which ``map`` maps them into rows like any page: N processes map one copy of a
  shared prefix. Imported pages are read-only by convention (the page table holds them as shared
  and copies on write); the backend refuses to write one (:meth:`CudaBackend.write_pages`, the
  destination of :meth:`CudaBackend.copy`). Releasing an imported page releases the imported
  handle only.
* **Loading pages from the host** (:meth:`CudaBackend.write_pages`): one host-to-device copy per
  page through the window, then a wait (a prefix file is read into device pages once);
  :meth:`CudaBackend.read_pages` is the way back.

Invariants: every created page id has exactly one slot, whose handle is mapped at that slot of
the window; spare slots hold handles no page uses; every slot of a readable reservation holds a
real page or the scratch page; ``resident_bytes() == (created pages + spares + scratch) *
page_bytes`` is what the driver holds for this backend (imported pages are the exporter's memory:
:attr:`CudaBackend.imported_pages` counts them); at most ``max_pages`` handles (scratch aside,
imported ones included: each takes a window slot) exist.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..memory.errors import ArgumentError, BackendError, CacheClosedError, KVCacheOutOfMemory
from ..memory.limits import MAX_CUDA_PAGE_BYTES, PageSizeError
from ..memory.pool import PageId
from ..memory.runs import consecutive_runs as _runs
from .driver import CudaDriverError, Driver, PageSharingError
from .hooks import TorchHooks, torch_hooks

__all__ = ["CudaBackend", "recv_page_fds", "send_page_fds"]

_OUT_OF_MEMORY = "CUDA_ERROR_OUT_OF_MEMORY"


def _alignment(page_bytes: int) -> int:
    """The reservation alignment for pages of ``page_bytes``: the largest power of two dividing it.

    ``cuMemAddressReserve`` takes a power of two (or 0); a page of 6 MiB is legal (a multiple of
    the 2 MiB granularity) but not a legal alignment. Its lowest set bit is a multiple of the
    granularity, so every page slot stays granularity-aligned, as ``cuMemMap`` requires."""
    return page_bytes & -page_bytes


class CudaBackend:
    """Device memory for one CUDA device through the driver's virtual memory management.

    Args:
        device: ``cuda:N`` (``cuda`` means the current device).
        page_bytes: bytes of one page; a multiple of the driver's granularity (default: the
            granularity itself, 2 MiB on H100/H200).
        max_pages: most handles (pages plus spares) held at once; sizes the window. Default: the
            device's memory divided by ``page_bytes``.
        create_ahead: handles created per batch when a page needs one and no spare is left (default
            one: no batching; the device policy's is :data:`hf_vkv.devices.CUDA_CREATE_AHEAD`).
        driver: a :class:`Driver` (default: one over ``cuda.bindings.driver`` for this device).
            The backend owns it: the driver is closed once the backend is closed and its last
            reservation given back.
        hooks: the torch side (default: :func:`~hf_vkv.cuda.hooks.torch_hooks`).
        shareable: create pages exportable as POSIX file descriptors, so that
            :meth:`export_pages` and :meth:`import_pages` work (both sides of a share need it).
            The device must support that handle type. A given ``driver`` must have been made
            with the same setting.
    """

    def __init__(self, device: torch.device | str, *, page_bytes: int | None = None, max_pages: int | None = None,
                 create_ahead: int = 1, driver: Driver | None = None,
                 hooks: TorchHooks | None = None, shareable: bool = False) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ArgumentError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(create_ahead, int) or create_ahead < 1:
            raise ArgumentError(f"create_ahead must be a positive int, got {create_ahead!r}")
        self.device = device
        self.create_ahead = create_ahead
        if driver is not None and bool(getattr(driver, "shareable", False)) != bool(shareable):
            raise ArgumentError(f"shareable={shareable!r} but the driver given was made with "
                                f"shareable={getattr(driver, 'shareable', False)!r}: pass the driver's value")
        self.shareable = bool(shareable)
        self._hooks = torch_hooks(device) if hooks is None else hooks
        self._driver = Driver(device.index, shareable=shareable) if driver is None else driver
        try:
            self._calls: dict[str, list[float]] = {}  # driver call -> [count, seconds]
            self._counts: Counter[str] = Counter()  # pages mapped / unmapped, waits: see counters()
            granularity = self._timed("granularity", self._driver.granularity)
            if page_bytes is None:
                page_bytes = granularity
            if not isinstance(page_bytes, int) or page_bytes <= 0 or page_bytes % granularity:
                raise PageSizeError(f"cache_config['page_bytes'] must be a positive multiple of the device's "
                                    f"allocation granularity ({granularity:,} bytes) up to {MAX_CUDA_PAGE_BYTES:,}, "
                                    f"got {page_bytes!r}")
            if page_bytes > max(MAX_CUDA_PAGE_BYTES, granularity):
                raise PageSizeError(f"cache_config['page_bytes']={page_bytes:,} is larger than {MAX_CUDA_PAGE_BYTES:,} "
                                    f"bytes; use a multiple of the granularity ({granularity:,}) up to that")
            self.page_bytes = page_bytes
            self.map_budget = None  # GPU virtual memory: not the process's vm.max_map_count
            self.gathered_copies = False  # copies run in order on the stream
            self._align = _alignment(page_bytes)
            if max_pages is None:
                max_pages = max(1, self._hooks.total_bytes() // page_bytes)
            if not isinstance(max_pages, int) or max_pages < 1:
                raise ArgumentError(f"max_pages must be a positive int, got {max_pages!r}")
            self.max_pages = max_pages
            self._id_space = 0
            self._slot_of: dict[PageId, int] = {}  # created page -> its window slot
            self._handle: dict[int, int] = {}  # window slot -> handle (pages' and spares')
            self._spares: list[int] = []  # slots whose handle no page uses
            self._imported: set[int] = set()  # slots whose handle was imported from another process
            self._empty: list[int] = []  # slots below _next_slot that hold no handle
            self._next_slot = 0
            self._mapped: dict[int, PageId] = {}  # row address of a mapped page -> that page
            self._scratch_at: set[int] = set()  # row addresses where the scratch page is mapped
            self._scratch: int | None = None  # handle of the scratch page (readable reservations)
            self._reservations: dict[int, int] = {}  # address -> nbytes (rows'; the window's is separate)
            self._readable: dict[int, int] = {}  # the readable ones among them
            self._closed = self._closing = False
            self._window = self._timed("reserve", self._driver.reserve, max_pages * page_bytes, self._align)
        except BaseException:
            if driver is None:  # the driver made here: a backend that raises holds no context
                self._driver.close()
            raise

    # ----------------------------------------------------------------------------- accounting
    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        # The one place every driver call and synchronize goes through (benchmarks wrap it).
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            entry = self._calls.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def call_stats(self) -> dict[str, tuple[int, float]]:
        """``{driver call: (calls, seconds)}`` since construction (waits count as
        ``"synchronize"``): what the benchmarks report as time spent mapping."""
        return {name: (int(n), s) for name, (n, s) in self._calls.items()}

    def counters(self) -> dict[str, int]:
        """Event counts since construction, for benchmarks to difference per step:

        * ``pages_mapped`` / ``pages_unmapped``: real pages mapped into / unmapped from rows (a
          beam reorder or copy-on-write swap of one page counts one of each);
        * ``scratch_mapped`` / ``scratch_unmapped``: the same for the scratch page;
        * ``map_runs`` / ``unmap_runs``: ``cuMemSetAccess`` / ``cuMemUnmap`` calls on rows;
        * ``synchronizes``: device synchronizes; ``idle_skips``: waits answered by an idle stream;
        * ``pages_copied``: page copies queued (copy-on-write);
        * ``pages_exported`` / ``pages_imported``: file descriptors given by :meth:`export_pages`,
          pages backed by :meth:`import_pages`; ``pages_written``: host-to-device page copies.
        """
        return dict(self._counts)

    def _open(self) -> None:
        if self._closed:
            raise CacheClosedError("this CUDA backend was closed; create a new cache")

    def _slot_address(self, slot: int) -> int:
        return self._window + slot * self.page_bytes

    def _handle_of(self, page: PageId) -> int:
        slot = self._slot_of.get(page)
        if slot is None:
            raise BackendError("cuMemMap", f"page {page} has no physical memory (it was never created or was released)")
        return self._handle[slot]

    def _wait_idle(self) -> None:
        """Return once no queued kernel can still use memory about to be unmapped (see the module
        docstring): free when torch's stream is already idle, else one device synchronize."""
        if self._hooks.stream_idle():
            self._counts["idle_skips"] += 1
            return
        self._timed("synchronize", self._hooks.synchronize)
        self._counts["synchronizes"] += 1

    # ----------------------------------------------------------------------------- physical pages
    def ensure_id_space(self, num_pages: int) -> None:
        self._open()
        self._id_space = max(self._id_space, num_pages)

    def create(self, pages: Sequence[PageId]) -> None:
        """Give each of ``pages`` a handle, from the spares or created now (a batch of at least
        ``create_ahead``). Raises :class:`KVCacheOutOfMemory`, with nothing changed, when
        ``max_pages`` or the device's memory cannot hold the missing handles."""
        self._open()
        self._check_new("create", pages)
        missing = len(pages) - len(self._spares)
        if missing > 0:
            held = len(self._handle)
            budget = self.max_pages * self.page_bytes
            if held + missing > self.max_pages:
                raise KVCacheOutOfMemory(requested_bytes=len(pages) * self.page_bytes,
                                         free_bytes=(self.max_pages - held + len(self._spares)) * self.page_bytes,
                                         budget_bytes=budget, what="device pages")
            try:
                self._create_for(missing, min(max(missing, self.create_ahead), self.max_pages - held))
            except CudaDriverError as exc:
                if exc.result != _OUT_OF_MEMORY:
                    raise
                # The budget was read from the driver once; torch's allocator may have grown since.
                free = min(self._hooks.free_bytes(), (self.max_pages - held) * self.page_bytes)
                raise KVCacheOutOfMemory(
                    requested_bytes=missing * self.page_bytes, free_bytes=free, budget_bytes=budget,
                    what=f"{missing} device page(s) on {self.device} (cuMemCreate: the device is out of memory; "
                         f"torch.cuda.empty_cache() returns torch's cached blocks to the driver)") from exc
        for page in pages:
            self._slot_of[page] = self._spares.pop()

    def _check_new(self, call: str, pages: Sequence[PageId]) -> None:
        """``pages`` may be given memory: in the id space, none has any yet, no duplicates."""
        for page in pages:
            if not 0 <= page < self._id_space:
                raise BackendError(call, f"page {page} is outside the id space {self._id_space}")
            if page in self._slot_of:
                raise BackendError(call, f"page {page} already has physical memory")
        if len(set(pages)) != len(pages):
            raise BackendError(call, f"duplicate page ids in {list(pages)[:8]}")

    def _pick_slots(self, count: int) -> tuple[list[int], int]:
        """``count`` window slots for new handles (emptied slots first), sorted, and how many of
        them are reused; :meth:`_commit_slots` takes them once the handles are in."""
        reuse = self._empty[len(self._empty) - min(count, len(self._empty)):]
        fresh = list(range(self._next_slot, self._next_slot + count - len(reuse)))
        return sorted(reuse + fresh), len(reuse)

    def _commit_slots(self, count: int, reused: int) -> None:
        del self._empty[len(self._empty) - reused:]
        self._next_slot += count - reused

    def _create_for(self, missing: int, batch: int) -> None:
        """Create ``batch`` spare handles; if the device is out of memory, exactly ``missing``."""
        try:
            self._create_handles(batch)
        except CudaDriverError as exc:
            if exc.result != _OUT_OF_MEMORY or batch == missing:
                raise
            self._counts["create_retries"] += 1
            self._create_handles(missing)

    def _create_handles(self, count: int) -> None:
        """Create ``count`` spare handles, each mapped at its window slot; all or nothing."""
        slots, reused = self._pick_slots(count)
        made: list[tuple[int, int]] = []  # (slot, handle), handle created
        mapped: list[int] = []
        d = self._driver
        try:
            for slot in slots:
                handle = self._timed("create", d.create, self.page_bytes)
                made.append((slot, handle))
                self._timed("map", d.map, self._slot_address(slot), self.page_bytes, handle)
                mapped.append(slot)
            for first, n in _runs(slots):
                self._timed("set_access", d.set_access, self._slot_address(first), n * self.page_bytes)
        except BaseException:
            # Nothing has used these slots: no wait needed. Unmap before release, whole runs.
            for first, n in _runs(mapped):
                self._timed("unmap", d.unmap, self._slot_address(first), n * self.page_bytes)
            for _, handle in made:
                self._timed("release", d.release, handle)
            raise
        self._commit_slots(count, reused)
        for slot, handle in made:
            self._handle[slot] = handle
        self._spares.extend(reversed(slots))  # pop() hands out the lowest slot first

    def release(self, pages: Sequence[PageId]) -> None:
        self._open()
        unknown = [p for p in pages if p not in self._slot_of]
        if unknown:
            raise BackendError("release", f"pages {unknown[:8]} have no physical memory")
        if not pages:
            return
        with self._driver.current():
            self._wait_idle()  # a copy may still use the window
            for page in pages:
                self._free_slot(self._slot_of[page])
                del self._slot_of[page]

    def _free_slot(self, slot: int) -> None:
        """Unmap ``slot`` from the window and release its handle (nothing may use it)."""
        self._timed("unmap", self._driver.unmap, self._slot_address(slot), self.page_bytes)
        try:
            self._timed("release", self._driver.release, self._handle[slot])
        except BaseException:  # the handle lives on unmapped: map it back so the slot stays usable
            self._timed("map", self._driver.map, self._slot_address(slot), self.page_bytes, self._handle[slot])
            self._timed("set_access", self._driver.set_access, self._slot_address(slot), self.page_bytes)
            raise
        del self._handle[slot]
        self._imported.discard(slot)
        self._empty.append(slot)

    def resident_bytes(self) -> int:
        """Bytes of every allocation this backend created and holds (pages, create-ahead spares,
        the scratch page); imported pages are another process's memory and not counted."""
        return (len(self._handle) - len(self._imported) + (self._scratch is not None)) * self.page_bytes

    @property
    def spare_pages(self) -> int:
        """Handles created ahead that no page uses yet."""
        return len(self._spares)

    @property
    def imported_pages(self) -> int:
        """Pages backed by :meth:`import_pages` and not yet released."""
        return len(self._imported)

    def is_imported(self, page: PageId) -> bool:
        """Whether ``page`` is backed by an imported allocation (read-only by convention)."""
        slot = self._slot_of.get(page)
        return slot is not None and slot in self._imported

    # ----------------------------------------------------------------------------- sharing
    def export_pages(self, pages: Sequence[PageId]) -> list[int]:
        """One POSIX file descriptor per page of ``pages`` (``cuMemExportToShareableHandle``), in
        order, for another process to :meth:`import_pages`. The caller owns the descriptors:
        close them once sent (an open descriptor keeps the memory alive). The pages stay this
        backend's; the other side never frees them. Raises :class:`PageSharingError` on a
        backend made without ``shareable``, for a page without memory, or for an imported page
        (export it from the process that created it); on failure no descriptor is left open."""
        self._open()
        call = "cuMemExportToShareableHandle"
        if not self.shareable:
            raise PageSharingError(call, "this backend was made without shareable handles: its pages cannot be "
                                         "exported (CudaBackend(..., shareable=True) creates exportable pages)")
        handles = []
        for page in pages:
            slot = self._slot_of.get(page)
            if slot is None:
                raise PageSharingError(call, f"page {page} has no physical memory (it was never created or was "
                                             f"released)")
            if slot in self._imported:
                raise PageSharingError(call, f"page {page} was imported from another process; export it from the "
                                             f"process that created it")
            handles.append(self._handle[slot])
        fds: list[int] = []
        try:
            with self._driver.current():
                for handle in handles:
                    fds.append(self._timed("export", self._driver.export, handle))
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
        self._counts["pages_exported"] += len(fds)
        return fds

    def import_pages(self, pages: Sequence[PageId], fds: Sequence[int], *, page_bytes: int | None = None) -> None:
        """Back ``pages`` (ids of this backend's id space without memory, as for :meth:`create`)
        with the allocations ``fds[k]`` name (descriptors another backend's :meth:`export_pages`
        gave, received with :func:`recv_page_fds`): ``cuMemImportFromShareableHandle``, then each
        handle is mapped at a window slot. The pages are then mapped into rows with :meth:`map`
        like any page; they must never be written (:meth:`write_pages` and :meth:`copy` refuse
        to); :meth:`release` releases the imported handle and leaves the exporter's memory alone.

        The descriptors stay the caller's: close them after the call. ``page_bytes``: the
        exporter's page size, when known (:func:`recv_page_fds` gives it); it must equal this
        backend's. All or nothing: on failure no page is imported. Raises
        :class:`PageSharingError` on a backend made without ``shareable``, for a descriptor that
        is not open or does not name an exported allocation, or for another page size."""
        self._open()
        call = "cuMemImportFromShareableHandle"
        if not self.shareable:
            raise PageSharingError(call, "this backend was made without shareable handles: it cannot import pages "
                                         "(CudaBackend(..., shareable=True))")
        if page_bytes is not None and page_bytes != self.page_bytes:
            raise PageSharingError(call, f"the exported pages are {page_bytes:,} bytes and this backend's "
                                         f"{self.page_bytes:,}: both sides need the same page_bytes")
        pages, fds = list(pages), list(fds)
        if len(pages) != len(fds):
            raise ArgumentError(f"import_pages needs one file descriptor per page, got {len(pages)} pages and "
                                f"{len(fds)} descriptors")
        self._check_new(call, pages)
        for fd in fds:
            if not isinstance(fd, int) or isinstance(fd, bool) or fd < 0:
                raise PageSharingError(call, f"{fd!r} is not a file descriptor")
            try:
                os.fstat(fd)
            except OSError as exc:
                raise PageSharingError(call, f"file descriptor {fd} is not open ({exc.strerror})") from exc
        if not pages:
            return
        held = len(self._handle)
        if held + len(pages) > self.max_pages:
            raise KVCacheOutOfMemory(requested_bytes=len(pages) * self.page_bytes,
                                     free_bytes=(self.max_pages - held) * self.page_bytes,
                                     budget_bytes=self.max_pages * self.page_bytes,
                                     what=f"window slots for {len(pages)} imported device page(s) (max_pages="
                                          f"{self.max_pages})")
        slots, reused = self._pick_slots(len(pages))
        made: list[int] = []
        mapped: list[int] = []
        d, size = self._driver, self.page_bytes
        try:
            with d.current():
                for slot, fd in zip(slots, fds):
                    try:
                        made.append(self._timed("import", d.import_handle, fd))
                    except CudaDriverError as exc:
                        raise PageSharingError(call, f"file descriptor {fd} does not name an allocation the driver "
                                                     f"can import ({exc.result}): pass descriptors export_pages "
                                                     f"gave") from exc
                    try:
                        self._timed("map", d.map, self._slot_address(slot), size, made[-1])
                    except CudaDriverError as exc:
                        if exc.result != "CUDA_ERROR_INVALID_VALUE":
                            raise
                        raise PageSharingError("cuMemMap", f"the allocation of file descriptor {fd} cannot be "
                                                           f"mapped as a page of {size:,} bytes ({exc.result}): "
                                                           f"is the exporter's page size another?") from exc
                    mapped.append(slot)
                for first, n in _runs(slots):
                    self._timed("set_access", d.set_access, self._slot_address(first), n * size)
        except BaseException:
            # No kernel has seen these slots: no wait. Unmap before release, whole runs.
            with d.current():
                for first, n in _runs(mapped):
                    self._timed("unmap", d.unmap, self._slot_address(first), n * size)
                for handle in made:
                    self._timed("release", d.release, handle)
            raise
        self._commit_slots(len(slots), reused)
        for page, slot, handle in zip(pages, slots, made):
            self._handle[slot] = handle
            self._slot_of[page] = slot
            self._imported.add(slot)
        self._counts["pages_imported"] += len(pages)

    def write_pages(self, pages: Sequence[PageId], data: torch.Tensor) -> None:
        """Copy ``data[k]`` (a ``uint8`` CPU tensor ``[len(pages), page_bytes]``, pinned or not)
        into page ``pages[k]``: one ``cuMemcpyHtoDAsync`` per page through the window on torch's
        current stream, then a wait, so ``data`` may be dropped or changed once this returns
        (loading a prefix file reads it into device pages once). Pages must have memory and not
        be imported (:class:`PageSharingError`: an importing process never writes one)."""
        self._open()
        call = "cuMemcpyHtoDAsync"
        pages = list(pages)
        if (not isinstance(data, torch.Tensor) or data.dtype != torch.uint8 or data.device.type != "cpu"
                or tuple(data.shape) != (len(pages), self.page_bytes)):
            got = (f"{data.dtype} {data.device} {tuple(data.shape)}" if isinstance(data, torch.Tensor)
                   else type(data).__name__)
            raise ArgumentError(f"data must be a uint8 CPU tensor of shape [{len(pages)}, {self.page_bytes}] (one row "
                                f"per page), got {got}")
        if len(set(pages)) != len(pages):
            raise BackendError(call, f"duplicate page ids in {pages[:8]}")
        slots = []
        for page in pages:
            slot = self._slot_of.get(page)
            if slot is None:
                raise BackendError(call, f"page {page} has no physical memory (it was never created or was released)")
            if slot in self._imported:
                raise PageSharingError(call, f"page {page} was imported from another process: an importing "
                                             f"process never writes it")
            slots.append(slot)
        if not pages:
            return
        data = data.contiguous()
        base, size = data.data_ptr(), self.page_bytes
        stream = self._hooks.stream()
        with self._driver.current():
            try:
                for k, slot in enumerate(slots):
                    self._timed("copy_from_host", self._driver.copy_from_host_async, self._slot_address(slot),
                                base + k * size, size, stream)
                    self._counts["pages_written"] += 1
            finally:  # the host bytes must outlive every copy queued (also when one failed)
                self._timed("synchronize", self._hooks.synchronize)
                self._counts["synchronizes"] += 1

    def read_pages(self, pages: Sequence[PageId]) -> torch.Tensor:
        """A ``uint8`` CPU copy ``[len(pages), page_bytes]`` of ``pages`` (created or imported):
        one ``cuMemcpyDtoHAsync`` per page through the window on torch's current stream (after
        the work queued there), then a wait."""
        self._open()
        pages = list(pages)
        slots = []
        for page in pages:
            slot = self._slot_of.get(page)
            if slot is None:
                raise BackendError("cuMemcpyDtoHAsync", f"page {page} has no physical memory (it was never created "
                                                        f"or was released)")
            slots.append(slot)
        out = torch.empty(len(pages), self.page_bytes, dtype=torch.uint8)
        if not pages:
            return out
        base, size = out.data_ptr(), self.page_bytes
        stream = self._hooks.stream()
        with self._driver.current():
            try:
                for k, slot in enumerate(slots):
                    self._timed("copy_to_host", self._driver.copy_to_host_async, base + k * size,
                                self._slot_address(slot), size, stream)
            finally:  # ``out`` must outlive every copy queued (also when one failed)
                self._timed("synchronize", self._hooks.synchronize)
                self._counts["synchronizes"] += 1
        return out

    # ----------------------------------------------------------------------------- address space
    def reserve(self, nbytes: int, *, readable: bool = False) -> int:
        """Reserve ``nbytes`` (a multiple of ``page_bytes``) of device address space.

        ``readable``: every page slot holds the scratch page until a real page is mapped there
        (one ``cuMemMap`` per slot: a single physical page cannot be mapped at several slots in
        one call, then one ``cuMemSetAccess`` over the whole range)."""
        self._open()
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % self.page_bytes:
            raise ArgumentError(f"nbytes must be a positive multiple of page_bytes ({self.page_bytes}), got {nbytes!r}")
        with self._driver.current():
            address = self._timed("reserve", self._driver.reserve, nbytes, self._align)
            if readable:
                try:
                    self._fill_scratch(address, list(range(nbytes // self.page_bytes)))
                except BaseException:
                    self._timed("address_free", self._driver.address_free, address, nbytes)
                    raise
        self._reservations[address] = nbytes
        if readable:
            self._readable[address] = nbytes
        return address

    def unreserve(self, address: int, nbytes: int) -> None:
        if self._reservations.get(address) != nbytes:  # a wrong call must not lose the record
            raise BackendError("cuMemAddressFree", f"no reservation of {nbytes} bytes at {address:#x}")
        with self._driver.current():
            # Normally only the scratch is left: buffers unmap their rows before giving the range back.
            self._unmap_slots(address, nbytes // self.page_bytes, scratch=True)
            self._timed("address_free", self._driver.address_free, address, nbytes)
        del self._reservations[address]
        self._readable.pop(address, None)
        self._maybe_close_driver()

    def _is_readable(self, address: int) -> bool:
        return any(base <= address < base + n for base, n in self._readable.items())

    def map(self, address: int, pages: Sequence[PageId]) -> None:
        """Map ``pages[k]`` at ``address + k * page_bytes``. A slot that holds another mapping (a
        page, or the scratch) is unmapped first, like ``mmap(MAP_FIXED)`` replaces one: the driver
        cannot map over a mapping. On failure nothing of this run holds a real page (in a
        readable reservation the scratch is put back; slots that held a page before the call
        are left without it: the caller restores them)."""
        self._open()
        if not pages:
            return
        handles = [self._handle_of(p) for p in pages]
        page = self.page_bytes
        with self._driver.current():
            self._unmap_slots(address, len(pages), scratch=True)
            done = 0
            try:
                for k, handle in enumerate(handles):
                    self._timed("map", self._driver.map, address + k * page, page, handle)
                    done += 1
                self._timed("set_access", self._driver.set_access, address, len(handles) * page)
            except BaseException:
                # No kernel has seen these pages (access was never granted or just now): unmap
                # them without waiting, so a failed map leaves nothing of the run mapped.
                kept = 0
                if done:
                    try:
                        self._timed("unmap", self._driver.unmap, address, done * page)
                    except BaseException:  # noqa: BLE001  (the map's own error is the one to report)
                        kept = done  # they stay mapped: recorded, so the caller's rollback or reset unmaps them
                        self._mapped.update((address + k * page, pages[k]) for k in range(kept))
                if self._is_readable(address):  # best effort: the caller's rollback (or reset) fills what is
                    with contextlib.suppress(BaseException):  # still empty; the map's own error is the one to report
                        self._fill_scratch(address, list(range(kept, len(pages))))
                raise
        for k, p in enumerate(pages):
            self._mapped[address + k * page] = p
        self._counts["pages_mapped"] += len(pages)
        self._counts["map_runs"] += 1

    def unmap(self, address: int, num_pages: int) -> None:
        """Unmap the real pages in ``num_pages`` slots from ``address`` (slots without one are
        skipped, so a rollback may unmap a range a failed map left half done); in a readable
        reservation every slot of the range holds the scratch page afterwards."""
        self._open()
        if num_pages <= 0:
            return
        with self._driver.current():
            self._unmap_slots(address, num_pages, scratch=False)
            if self._is_readable(address):
                page = self.page_bytes
                self._fill_scratch(address, [k for k in range(num_pages) if address + k * page not in self._scratch_at])

    def reset(self, address: int, nbytes: int) -> None:
        """Unmap every real page of the reservation at ``address``; in a readable one, every slot
        holds the scratch page afterwards (the last resort of a rollback that failed: no slot a
        kernel may read is left unbacked)."""
        self._open()
        if self._reservations.get(address) != nbytes:
            raise BackendError("reset", f"no reservation of {nbytes} bytes at {address:#x}")
        with self._driver.current():
            num_pages = nbytes // self.page_bytes
            self._unmap_slots(address, num_pages, scratch=False)
            if self._is_readable(address):
                page = self.page_bytes
                self._fill_scratch(address, [k for k in range(num_pages) if address + k * page not in self._scratch_at])

    def _unmap_slots(self, address: int, num_pages: int, *, scratch: bool) -> None:
        """Wait (once), then unmap the real pages (and the scratch too if ``scratch``) mapped in
        the ``num_pages`` slots from ``address``, one ``cuMemUnmap`` per run of mapped slots."""
        page = self.page_bytes
        slots = [k for k in range(num_pages)
                 if address + k * page in self._mapped or (scratch and address + k * page in self._scratch_at)]
        if not slots:
            return
        self._wait_idle()
        for first, n in _runs(slots):
            start = address + first * page
            self._timed("unmap", self._driver.unmap, start, n * page)
            self._counts["unmap_runs"] += 1
            for k in range(n):
                a = start + k * page
                if self._mapped.pop(a, None) is not None:
                    self._counts["pages_unmapped"] += 1
                else:
                    self._scratch_at.discard(a)
                    self._counts["scratch_unmapped"] += 1

    def _fill_scratch(self, address: int, slots: list[int]) -> None:
        """Map the scratch page at each of ``slots`` (indices from ``address``, all unmapped) and
        grant access per run; all or nothing."""
        if not slots:
            return
        if self._scratch is None:
            self._scratch = self._new_scratch()
        page, d = self.page_bytes, self._driver
        mapped: list[int] = []
        try:
            for k in slots:
                self._timed("map", d.map, address + k * page, page, self._scratch)
                mapped.append(k)
            for first, n in _runs(slots):
                self._timed("set_access", d.set_access, address + first * page, n * page)
        except BaseException:
            runs = list(_runs(mapped))
            for i, (first, n) in enumerate(runs):  # never granted to a kernel: no wait
                try:
                    self._timed("unmap", d.unmap, address + first * page, n * page)
                except BaseException:  # this run and the next stay mapped: recorded, so that a reset
                    # or the reservation's end unmaps them
                    self._scratch_at.update(address + k * page for f, m in runs[i:] for k in range(f, f + m))
                    raise
            raise
        self._scratch_at.update(address + k * page for k in slots)
        self._counts["scratch_mapped"] += len(slots)

    def _new_scratch(self) -> int:
        try:
            return self._timed("create", self._driver.create, self.page_bytes)
        except CudaDriverError as exc:
            if exc.result != _OUT_OF_MEMORY:
                raise
            raise KVCacheOutOfMemory(requested_bytes=self.page_bytes, free_bytes=self._hooks.free_bytes(),
                                     budget_bytes=self.max_pages * self.page_bytes,
                                     what=f"the scratch page of a readable reservation on {self.device}") from exc

    def mapped(self) -> dict[int, PageId]:
        """``{row address: page}`` of every real page mapped outside the window (a copy)."""
        return dict(self._mapped)

    def scratch_addresses(self) -> set[int]:
        """Row addresses where the scratch page is mapped (a copy)."""
        return set(self._scratch_at)

    def handle(self, page: PageId) -> int:
        """The allocation handle backing ``page`` (tests compare it with what the driver reports)."""
        return self._handle_of(page)

    # ----------------------------------------------------------------------------- data
    def copy(self, pairs: Sequence[tuple[PageId, PageId]], nbytes: Sequence[int] | None = None) -> None:
        """Queue a page copy per ``(src, dst)`` on torch's current stream (through the window):
        its first ``nbytes[k]`` bytes (the written part), or the whole page."""
        self._open()
        if not pairs:
            return
        slots = []
        for src, dst in pairs:
            for p in (src, dst):
                if p not in self._slot_of:
                    raise BackendError("cuMemcpyDtoDAsync", f"page {p} has no physical memory")
            if self._slot_of[dst] in self._imported:
                raise PageSharingError("cuMemcpyDtoDAsync", f"page {dst} was imported from another process: an "
                                                            f"importing process never writes it")
            slots.append((self._slot_of[src], self._slot_of[dst]))
        stream = self._hooks.stream()
        with self._driver.current():
            for k, (s, d) in enumerate(slots):
                n = self.page_bytes if nbytes is None else nbytes[k]
                if n:
                    self._timed("copy", self._driver.copy_async, self._slot_address(d), self._slot_address(s),
                                n, stream)
                self._counts["pages_copied"] += 1

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        return self._hooks.tensor(address, nbytes, owner)

    def close(self) -> None:
        """Unmap every page (and scratch) still mapped in a row, release every handle and free
        the window. Row reservations stay until their owners give them back (:meth:`unreserve`
        works after close); the driver's context is released with the last of them."""
        if self._closed:
            return
        self._closed = True
        self._closing = True  # an unreserve meanwhile (a finalizer) leaves the driver open for the rest
        errors: list[BaseException] = []
        try:
            with self._driver.current():
                self._close_pages(errors)
        finally:
            self._closing = False
        self._maybe_close_driver()
        if errors:
            raise errors[0]

    def _close_pages(self, errors: list[BaseException]) -> None:
        """:meth:`close`'s work, the context current: what fails goes to ``errors`` and the rest goes on."""
        self._timed("synchronize", self._hooks.synchronize)
        self._counts["synchronizes"] += 1
        page = self.page_bytes
        # a copy, each checked again: a collection the hooks run may call a finalizer that gives one back (unreserve)
        for base, nbytes in list(self._reservations.items()):  # runs never span two reservations
            if self._reservations.get(base) != nbytes:
                continue
            try:
                self._unmap_slots(base, nbytes // page, scratch=True)
            except BaseException as exc:  # noqa: BLE001  (free what can be freed, then report)
                errors.append(exc)
        self._mapped.clear()
        self._scratch_at.clear()
        for slot in sorted(self._handle):
            try:
                self._free_slot(slot)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        self._slot_of.clear()
        self._spares.clear()
        self._imported.clear()
        if self._scratch is not None:
            try:
                self._timed("release", self._driver.release, self._scratch)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
            self._scratch = None
        try:
            self._timed("address_free", self._driver.address_free, self._window, self.max_pages * page)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def _maybe_close_driver(self) -> None:
        # Reservations outlive close() (tensors may hold them); each unreserve needs the context.
        if self._closed and not self._closing and not self._reservations:
            self._driver.close()


# ------------------------------------------------------------------------------------- fd passing
#: File descriptors per message: Linux takes at most 253 (``SCM_MAX_FD``) in one ``SCM_RIGHTS``.
FDS_PER_MESSAGE = 250
_HEADER = struct.Struct("<QQQ")  # descriptors in all, page_bytes, descriptors in this message


def send_page_fds(sock: socket.socket, fds: Sequence[int], *, page_bytes: int) -> None:
    """Send ``fds`` (from :meth:`CudaBackend.export_pages`) and the exporter's ``page_bytes`` over
    a connected ``AF_UNIX`` socket (``SCM_RIGHTS``: the receiver gets its own descriptors to the
    same allocations), in messages of at most :data:`FDS_PER_MESSAGE`. The sender's descriptors
    stay open: close them after sending."""
    fds = list(fds)
    chunks = [fds[i:i + FDS_PER_MESSAGE] for i in range(0, len(fds), FDS_PER_MESSAGE)] or [[]]
    for chunk in chunks:
        header = _HEADER.pack(len(fds), page_bytes, len(chunk))
        sent = socket.send_fds(sock, [header], chunk) if chunk else sock.send(header)
        if sent != _HEADER.size:  # the descriptors travel with the first byte: send the rest plainly
            sock.sendall(header[sent:])


def recv_page_fds(sock: socket.socket) -> tuple[list[int], int]:
    """Receive what :func:`send_page_fds` sent: ``(fds, page_bytes)``, the descriptors now this
    process's (pass them to :meth:`CudaBackend.import_pages`, then close them). Raises
    :class:`PageSharingError` (closing whatever arrived) if the peer closes early or the
    descriptors do not arrive as announced."""
    fds: list[int] = []
    try:
        while True:
            data, got, flags, _ = socket.recv_fds(sock, _HEADER.size, FDS_PER_MESSAGE)
            fds.extend(got)
            if flags & socket.MSG_CTRUNC:
                raise PageSharingError("recvmsg", "file descriptors were cut off (MSG_CTRUNC): the process may be "
                                                  "out of descriptors (ulimit -n)")
            while data and len(data) < _HEADER.size:
                more = sock.recv(_HEADER.size - len(data))
                if not more:
                    break
                data += more
            if len(data) != _HEADER.size:
                raise PageSharingError("recvmsg", f"the peer closed the socket after {len(fds)} descriptor(s)")
            total, page_bytes, count = _HEADER.unpack(data)
            if len(got) != count:
                raise PageSharingError("recvmsg", f"a message announced {count} descriptor(s) and carried "
                                                  f"{len(got)}")
            if len(fds) >= total:
                if len(fds) != total:
                    raise PageSharingError("recvmsg", f"{len(fds)} descriptors arrived, {total} were announced")
                return fds, page_bytes
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
