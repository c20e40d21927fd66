"""The CUDA backend: physical pages are ``cuMemCreate`` allocations mapped into reserved device
virtual memory with ``cuMemMap`` (the vAttention approach), behind the
:class:`~hf_vkv.memory.backend.Backend` protocol.

* **Pages and handles.** Page id ``p`` is backed by one allocation handle of ``page_bytes`` (the
  driver maps whole allocations only: one handle per page). Creating a handle is the slow call
  (30-200 µs a 2 MiB page on an A100), so handles are created ahead in batches of
  ``create_ahead`` and kept as *spares* until a page needs one.
* **The window.** Every handle is also mapped once, at creation, into a backend-owned reservation
  (slot ``k`` at ``window + k * page_bytes``). Copy-on-write copies a page to a page that is not
  mapped in any row yet; the window gives both an address. It costs virtual address space only.
* **Map a run** = ``cuMemMap`` per page, then one ``cuMemSetAccess`` over the run. If a call fails
  part way, the pages mapped so far are unmapped again: a failed ``map`` leaves nothing of the run
  mapped. The driver cannot map over a mapping, so slots that hold another page (a beam reorder,
  a copy-on-write swap) are unmapped first, as ``mmap(MAP_FIXED)`` would replace them.
* **Unmap** synchronizes the device first (a kernel still reading the range would fault the
  context: Xid 31), then unmaps each run of mapped slots with one call; slots already unmapped
  are skipped. The backend records what it mapped where (:meth:`CudaBackend.mapped`).
* **Release** unmaps a page from the window (after a synchronize) and releases its handle; the
  memory goes back to the driver at once. The pool's resident free pages are the recycle cache.

Invariants: every created page id has exactly one slot, whose handle is mapped at that slot of
the window; spare slots hold handles no page uses; ``resident_bytes() == (pages + spares) *
page_bytes`` is what the driver holds for this backend; at most ``max_pages`` handles exist.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from ..memory.errors import BackendError, CacheClosedError, KVCacheOutOfMemory
from ..memory.pool import PageId
from .driver import Driver
from .hooks import TorchHooks, torch_hooks

__all__ = ["CudaBackend", "DEFAULT_CREATE_AHEAD"]

#: Handles created per batch when no spare is left (16 x 2 MiB = 32 MiB of device memory).
DEFAULT_CREATE_AHEAD = 16


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Split sorted ``slots`` into runs of consecutive values: ``(first, length)``."""
    i = 0
    while i < len(slots):
        j = i + 1
        while j < len(slots) and slots[j] == slots[j - 1] + 1:
            j += 1
        yield slots[i], j - i
        i = j


class CudaBackend:
    """Device memory for one CUDA device through the driver's virtual memory management.

    Args:
        device: ``cuda:N`` (``cuda`` means the current device).
        page_bytes: bytes of one page; a multiple of the driver's granularity (default: the
            granularity itself, 2 MiB on H100/H200).
        max_pages: most handles (pages plus spares) held at once; sizes the window. Default: the
            device's memory divided by ``page_bytes``.
        create_ahead: handles created per batch when a page needs one and no spare is left.
        driver: a :class:`Driver` (default: one over ``cuda.bindings.driver`` for this device).
        hooks: the torch side (default: :func:`~hf_vkv.cuda.hooks.torch_hooks`).
    """

    def __init__(self, device: torch.device | str, *, page_bytes: int | None = None, max_pages: int | None = None,
                 create_ahead: int = DEFAULT_CREATE_AHEAD, driver: Driver | None = None,
                 hooks: TorchHooks | None = None) -> None:
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"device must be a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if not isinstance(create_ahead, int) or create_ahead < 1:
            raise ValueError(f"create_ahead must be a positive int, got {create_ahead!r}")
        self.device = device
        self.create_ahead = create_ahead
        self._hooks = torch_hooks(device) if hooks is None else hooks
        self._driver = Driver(device.index) if driver is None else driver
        self._calls: dict[str, list[float]] = {}  # driver call -> [count, seconds]
        with self._hooks.guard():
            granularity = self._timed("granularity", self._driver.granularity)
        if page_bytes is None:
            page_bytes = granularity
        if not isinstance(page_bytes, int) or page_bytes <= 0 or page_bytes % granularity:
            raise ValueError(f"page_bytes must be a positive multiple of the device's allocation granularity "
                             f"({granularity:,} bytes), got {page_bytes!r}")
        self.page_bytes = page_bytes
        if max_pages is None:
            max_pages = max(1, self._hooks.total_bytes() // page_bytes)
        if not isinstance(max_pages, int) or max_pages < 1:
            raise ValueError(f"max_pages must be a positive int, got {max_pages!r}")
        self.max_pages = max_pages
        self._id_space = 0
        self._slot_of: dict[PageId, int] = {}  # created page -> its window slot
        self._handle: dict[int, int] = {}  # window slot -> handle (pages' and spares')
        self._spares: list[int] = []  # slots whose handle no page uses
        self._empty: list[int] = []  # slots below _next_slot that hold no handle
        self._next_slot = 0
        self._mapped: dict[int, PageId] = {}  # row address of a mapped page -> that page
        self._reservations: dict[int, int] = {}  # address -> nbytes (rows'; the window's is separate)
        self._closed = False
        with self._hooks.guard():
            self._window = self._timed("reserve", self._driver.reserve, max_pages * page_bytes, page_bytes)

    # ----------------------------------------------------------------------------- helpers
    def _timed(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            entry = self._calls.setdefault(name, [0, 0.0])
            entry[0] += 1
            entry[1] += time.perf_counter() - start

    def call_stats(self) -> dict[str, tuple[int, float]]:
        """``{driver call: (calls, seconds)}`` since construction (the synchronize before an unmap
        counts as ``"synchronize"``): what the benchmarks report as time spent mapping."""
        return {name: (int(n), s) for name, (n, s) in self._calls.items()}

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

    # ----------------------------------------------------------------------------- physical pages
    def ensure_id_space(self, num_pages: int) -> None:
        self._open()
        self._id_space = max(self._id_space, num_pages)

    def create(self, pages: Sequence[PageId]) -> None:
        self._open()
        for page in pages:
            if not 0 <= page < self._id_space:
                raise BackendError("create", f"page {page} is outside the id space {self._id_space}")
            if page in self._slot_of:
                raise BackendError("create", f"page {page} already has physical memory")
        if len(set(pages)) != len(pages):
            raise BackendError("create", f"duplicate page ids in {list(pages)[:8]}")
        missing = len(pages) - len(self._spares)
        if missing > 0:
            held = len(self._handle)
            if held + missing > self.max_pages:
                raise KVCacheOutOfMemory(requested_bytes=len(pages) * self.page_bytes,
                                         free_bytes=(self.max_pages - held + len(self._spares)) * self.page_bytes,
                                         budget_bytes=self.max_pages * self.page_bytes, what="device pages")
            self._create_handles(min(max(missing, self.create_ahead), self.max_pages - held))
        for page in pages:
            self._slot_of[page] = self._spares.pop()

    def _create_handles(self, count: int) -> None:
        """Create ``count`` spare handles, each mapped at its window slot; all or nothing."""
        reuse = self._empty[len(self._empty) - min(count, len(self._empty)):]
        fresh = list(range(self._next_slot, self._next_slot + count - len(reuse)))
        slots = sorted(reuse + fresh)
        made: list[tuple[int, int]] = []  # (slot, handle), handle created
        mapped: list[int] = []
        d = self._driver
        try:
            with self._hooks.guard():
                for slot in slots:
                    handle = self._timed("create", d.create, self.page_bytes)
                    made.append((slot, handle))
                    self._timed("map", d.map, self._slot_address(slot), self.page_bytes, handle)
                    mapped.append(slot)
                for first, n in _runs(slots):
                    self._timed("set_access", d.set_access, self._slot_address(first), n * self.page_bytes)
        except BaseException:
            with self._hooks.guard():  # nothing has used these slots: no synchronize needed
                for slot in mapped:
                    self._timed("unmap", d.unmap, self._slot_address(slot), self.page_bytes)
                for _, handle in made:
                    self._timed("release", d.release, handle)
            raise
        del self._empty[len(self._empty) - len(reuse):]
        self._next_slot += len(fresh)
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
        with self._hooks.guard():
            self._timed("synchronize", self._hooks.synchronize)  # a copy may still read the window
            for page in pages:
                self._free_slot(self._slot_of[page])
                del self._slot_of[page]

    def _free_slot(self, slot: int) -> None:
        """Unmap ``slot`` from the window and release its handle (device idle, guard held)."""
        self._timed("unmap", self._driver.unmap, self._slot_address(slot), self.page_bytes)
        try:
            self._timed("release", self._driver.release, self._handle[slot])
        except BaseException:  # the handle lives on unmapped: map it back so the slot stays usable
            self._timed("map", self._driver.map, self._slot_address(slot), self.page_bytes, self._handle[slot])
            self._timed("set_access", self._driver.set_access, self._slot_address(slot), self.page_bytes)
            raise
        del self._handle[slot]
        self._empty.append(slot)

    def resident_bytes(self) -> int:
        """Bytes of every handle this backend holds (pages and create-ahead spares)."""
        return len(self._handle) * self.page_bytes

    @property
    def spare_pages(self) -> int:
        """Handles created ahead that no page uses yet."""
        return len(self._spares)

    # ----------------------------------------------------------------------------- address space
    def reserve(self, nbytes: int) -> int:
        self._open()
        if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % self.page_bytes:
            raise ValueError(f"nbytes must be a positive multiple of page_bytes ({self.page_bytes}), got {nbytes!r}")
        with self._hooks.guard():
            address = self._timed("reserve", self._driver.reserve, nbytes, self.page_bytes)
        self._reservations[address] = nbytes
        return address

    def unreserve(self, address: int, nbytes: int) -> None:
        if self._reservations.get(address) != nbytes:  # a wrong call must not lose the record
            raise BackendError("cuMemAddressFree", f"no reservation of {nbytes} bytes at {address:#x}")
        with self._hooks.guard():
            inside = sorted(a for a in self._mapped if address <= a < address + nbytes)
            if inside:  # normally none: buffers unmap their rows before giving the range back
                self._timed("synchronize", self._hooks.synchronize)
                for a in inside:
                    self._timed("unmap", self._driver.unmap, a, self.page_bytes)
                    del self._mapped[a]
            self._timed("address_free", self._driver.address_free, address, nbytes)
        del self._reservations[address]

    def map(self, address: int, pages: Sequence[PageId]) -> None:
        """Map ``pages[k]`` at ``address + k * page_bytes``. A slot that holds another mapping is
        unmapped first (after a synchronize), like ``mmap(MAP_FIXED)`` replaces one: the driver
        cannot map over a mapping. On failure nothing of this run stays mapped (slots that held
        a page before the call are left unmapped; the caller restores them)."""
        self._open()
        if not pages:
            return
        handles = [self._handle_of(p) for p in pages]
        page = self.page_bytes
        with self._hooks.guard():
            self._unmap_present(address, len(pages))
            done = 0
            try:
                for k, handle in enumerate(handles):
                    self._timed("map", self._driver.map, address + k * page, page, handle)
                    done += 1
                self._timed("set_access", self._driver.set_access, address, len(handles) * page)
            except BaseException:
                # No kernel has seen these pages (access was never granted or just now): unmap
                # them without a synchronize, so a failed map leaves nothing of the run mapped.
                if done:
                    self._timed("unmap", self._driver.unmap, address, done * page)
                raise
        for k, p in enumerate(pages):
            self._mapped[address + k * page] = p

    def unmap(self, address: int, num_pages: int) -> None:
        """Unmap whatever is mapped in ``num_pages`` slots from ``address`` (slots already
        unmapped are skipped, so a rollback may unmap a range a failed map left half done)."""
        self._open()
        if num_pages > 0:
            with self._hooks.guard():
                self._unmap_present(address, num_pages)

    def _unmap_present(self, address: int, num_pages: int) -> None:
        """Synchronize, then unmap the mapped slots of the range, one call per run (guard held)."""
        page = self.page_bytes
        slots = [k for k in range(num_pages) if address + k * page in self._mapped]
        if not slots:
            return
        self._timed("synchronize", self._hooks.synchronize)
        for first, n in _runs(slots):
            start = address + first * page
            self._timed("unmap", self._driver.unmap, start, n * page)
            for k in range(n):
                del self._mapped[start + k * page]

    def mapped(self) -> dict[int, PageId]:
        """``{row address: page}`` of every page mapped outside the window (a copy)."""
        return dict(self._mapped)

    def handle(self, page: PageId) -> int:
        """The allocation handle backing ``page`` (tests compare it with what the driver reports)."""
        return self._handle_of(page)

    # ----------------------------------------------------------------------------- data
    def copy(self, pairs: Sequence[tuple[PageId, PageId]]) -> None:
        """Queue a page copy per ``(src, dst)`` on the current stream (through the window)."""
        self._open()
        if not pairs:
            return
        slots = []
        for src, dst in pairs:
            for p in (src, dst):
                if p not in self._slot_of:
                    raise BackendError("cuMemcpyDtoDAsync", f"page {p} has no physical memory")
            slots.append((self._slot_of[src], self._slot_of[dst]))
        with self._hooks.guard():
            stream = self._hooks.stream()
            for s, d in slots:
                self._timed("copy", self._driver.copy_async, self._slot_address(d), self._slot_address(s),
                            self.page_bytes, stream)

    def tensor(self, address: int, nbytes: int, owner: object) -> torch.Tensor:
        return self._hooks.tensor(address, nbytes, owner)

    def close(self) -> None:
        """Unmap every page still mapped in a row, release every handle and free the window.
        Row reservations stay until their owners give them back (:meth:`unreserve` works after
        close)."""
        if self._closed:
            return
        self._closed = True
        with self._hooks.guard():
            self._timed("synchronize", self._hooks.synchronize)
            errors: list[BaseException] = []
            for address in sorted(self._mapped):
                try:
                    self._timed("unmap", self._driver.unmap, address, self.page_bytes)
                except BaseException as exc:  # noqa: BLE001  (free what can be freed, then report)
                    errors.append(exc)
            self._mapped.clear()
            for slot in sorted(self._handle):
                try:
                    self._free_slot(slot)
                except BaseException as exc:  # noqa: BLE001
                    errors.append(exc)
            self._slot_of.clear()
            self._spares.clear()
            try:
                self._timed("address_free", self._driver.address_free, self._window, self.max_pages * self.page_bytes)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)
        if errors:
            raise errors[0]
