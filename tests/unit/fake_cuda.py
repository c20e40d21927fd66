"""A strict, recording fake of ``cuda.bindings.driver`` for the CUDA backend's CPU tests.

It keeps what a driver keeps and refuses what the CUDA 13 driver API documents as invalid
(cuda.h doc comments; ``docs/notes/vmm.md`` §1.5), with the result a real driver returns:

* ``cuInit`` first (``CUDA_ERROR_NOT_INITIALIZED``); memory calls need a current context on the
  calling thread (``CUDA_ERROR_INVALID_CONTEXT``): contexts are current *per thread*, and a
  thread that made no CUDA call (a finalizer's, a deleter's) has none;
* ``cuMemAddressReserve``: alignment 0 or a power of two, size a multiple of the host page;
* ``cuMemCreate``: size a multiple of the minimum granularity; the device's memory is finite
  (``CUDA_ERROR_OUT_OF_MEMORY`` past ``device_bytes``);
* ``cuMemMap``: offset 0, address and size multiples of the granularity, the whole allocation,
  inside one reservation, onto unmapped space only, with a live handle reference;
* ``cuMemSetAccess`` / ``cuMemUnmap``: whole mappings only; ``cuMemAddressFree``: an exact, empty
  reservation;
* ``cuMemRelease`` drops a handle *reference*: memory still mapped stays (and stays mapped) until
  its last mapping goes; ``cuMemRetainAllocationHandle`` takes one more reference;
* streams: 0 is the legacy default stream, or the calling thread's per-thread stream when the
  bindings run in per-thread mode (``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1``); copies
  record the stream they really ran on;
* work in flight (:meth:`FakeCu.launch`, copies) keeps its ranges busy until a synchronize;
  unmapping a busy range is what makes a real GPU fault (Xid 31): the fake returns
  ``CUDA_ERROR_ILLEGAL_ADDRESS`` at once.

Every call is recorded with its arguments; ``fail(name, nth, error)`` makes the n-th next call of
a function return ``error`` without doing anything.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from hf_vkv.cuda import CudaBackend, Driver, TorchHooks

MIN_GRAN, REC_GRAN = 64 * 1024, 128 * 1024
PAGE = REC_GRAN  # the backend takes the larger granularity
HOST_PAGE = 4096
STREAM = 0x5EED  # torch's current stream in the fake hooks, unless told otherwise
PRIMARY = 0xC0DE0  # context handle of device 0's primary context (device d: PRIMARY + d)
LEGACY, PER_THREAD = 0x1, 0x2  # CU_STREAM_LEGACY, CU_STREAM_PER_THREAD


class CUresult(enum.IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_SUPPORTED = 801


_DESCRIPTIONS = {CUresult.CUDA_ERROR_OUT_OF_MEMORY: b"out of memory",
                 CUresult.CUDA_ERROR_INVALID_VALUE: b"invalid argument",
                 CUresult.CUDA_ERROR_INVALID_CONTEXT: b"invalid device context"}
OK = CUresult.CUDA_SUCCESS


def _location() -> SimpleNamespace:
    return SimpleNamespace(type=None, id=None)


@dataclass
class Allocation:
    size: int
    refs: int = 1  # handle references (cuMemCreate's, cuMemRetainAllocationHandle's)
    maps: int = 0  # addresses it is mapped at


class FakeCu:
    """A strict recording stand-in for ``cuda.bindings.driver`` (the names hf_vkv uses)."""

    CUresult = CUresult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="PINNED")
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_NONE="NONE")
    CUmemLocationType = SimpleNamespace(CU_MEM_LOCATION_TYPE_DEVICE="DEVICE")
    CUmemAccess_flags = SimpleNamespace(CU_MEM_ACCESS_FLAGS_PROT_READWRITE="RW")
    CUmemAllocationGranularity_flags = SimpleNamespace(CU_MEM_ALLOC_GRANULARITY_MINIMUM="MIN",
                                                       CU_MEM_ALLOC_GRANULARITY_RECOMMENDED="REC")

    @staticmethod
    def CUmemAllocationProp() -> SimpleNamespace:  # noqa: N802  (the bindings' name)
        return SimpleNamespace(type=None, requestedHandleTypes=None, location=_location())

    @staticmethod
    def CUmemAccessDesc() -> SimpleNamespace:  # noqa: N802
        return SimpleNamespace(location=_location(), flags=None)

    def __init__(self, *, device_bytes: int = 1 << 30, per_thread_default_stream: bool = False) -> None:
        self.device_bytes = device_bytes
        self.per_thread_default_stream = per_thread_default_stream
        self.calls: list[tuple] = []
        self.reservations: dict[int, int] = {}  # address -> size
        self.allocations: dict[int, Allocation] = {}  # handle -> allocation (memory held)
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()  # mapped addresses with access granted
        self.copies: list[tuple[int, int, int, object]] = []  # (dst, src, nbytes, stream it ran on)
        self.inflight: list[tuple[int, int]] = []  # [lo, hi) ranges queued work still uses
        self.primary_refs: dict[int, int] = {}  # device -> primary context retains
        self._initialized = False
        self._tls = threading.local()  # per thread: the context stack
        self._faults: dict[str, tuple[int, CUresult]] = {}
        self._counts: dict[str, int] = {}
        self._next_address = 1 << 40
        self._next_handle = 1

    # ----------------------------------------------------------------------------- test controls
    def fail(self, name: str, nth: int = 1, error: CUresult = CUresult.CUDA_ERROR_OUT_OF_MEMORY) -> None:
        """Make the ``nth`` next call of ``name`` return ``error`` (doing nothing)."""
        self._faults[name] = (self._counts.get(name, 0) + nth, error)

    def pending(self) -> bool:
        return bool(self._faults)

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]

    def clear_calls(self) -> None:
        self.calls.clear()

    @property
    def handles(self) -> dict[int, int]:
        """Live handle references: ``{handle: size}``."""
        return {h: a.size for h, a in self.allocations.items() if a.refs}

    def used_bytes(self) -> int:
        return sum(a.size for a in self.allocations.values())

    def make_current(self, device: int = 0) -> None:
        """What torch's runtime does on a thread that makes a CUDA call: retain the primary
        context (torch never releases it) and make it current on this thread."""
        self.primary_refs[device] = self.primary_refs.get(device, 0) + 1
        self._stack().append(PRIMARY + device)

    def launch(self, address: int, nbytes: int) -> None:
        """A kernel queued on the device that reads ``[address, address + nbytes)``."""
        assert self._covered(address, nbytes) and all(a in self.accessible for a in self._covered(address, nbytes))
        self.inflight.append((address, address + nbytes))

    def synchronize(self) -> None:
        self.calls.append(("synchronize",))
        self.inflight.clear()

    def stream_idle(self) -> bool:
        self.calls.append(("stream_idle",))
        return not self.inflight

    # ----------------------------------------------------------------------------- bookkeeping
    def _stack(self) -> list[int]:
        if not hasattr(self._tls, "stack"):
            self._tls.stack = []
        return self._tls.stack

    def _enter(self, name: str, *args, context: bool = True) -> CUresult | None:
        self.calls.append((name, *args))
        n = self._counts[name] = self._counts.get(name, 0) + 1
        fault = self._faults.get(name)
        if fault and fault[0] == n:
            del self._faults[name]
            return fault[1]
        if name != "cuInit" and not self._initialized:
            return CUresult.CUDA_ERROR_NOT_INITIALIZED
        if context:
            stack = self._stack()
            if not stack or self.primary_refs.get(stack[-1] - PRIMARY, 0) == 0:
                return CUresult.CUDA_ERROR_INVALID_CONTEXT
        return None

    def _reservation_of(self, ptr: int, size: int) -> int | None:
        return next((base for base, n in self.reservations.items() if base <= ptr and ptr + size <= base + n), None)

    def _overlaps(self, ptr: int, size: int) -> bool:
        return any(a < ptr + size and ptr < a + n for a, (n, _) in self.mappings.items())

    def _covered(self, ptr: int, size: int, *, partial_end: bool = False) -> list[int] | None:
        """The mappings that tile ``[ptr, ptr + size)`` exactly, or None; with ``partial_end`` the
        last may run past its end (a copy of the written part of a page)."""
        out, a = [], ptr
        while a < ptr + size:
            if a not in self.mappings:
                return None
            out.append(a)
            a += self.mappings[a][0]
        return out if a == ptr + size or (partial_end and a > ptr + size) else None

    def _busy(self, ptr: int, size: int) -> bool:
        return any(lo < ptr + size and ptr < hi for lo, hi in self.inflight)

    def _drop(self, handle: int) -> None:
        alloc = self.allocations[handle]
        if alloc.refs == 0 and alloc.maps == 0:
            del self.allocations[handle]  # the memory goes back to the device

    # ----------------------------------------------------------------------------- the driver calls
    def cuInit(self, flags):  # noqa: N802
        err = self._enter("cuInit", flags, context=False)
        self._initialized = self._initialized or not err
        return (err or OK,)

    def cuGetErrorName(self, err):  # noqa: N802
        return OK, CUresult(err).name.encode()

    def cuGetErrorString(self, err):  # noqa: N802
        return OK, _DESCRIPTIONS.get(err, b"unknown error")

    def cuDriverGetVersion(self):  # noqa: N802
        return OK, 13000

    def cuDeviceGet(self, ordinal):  # noqa: N802
        err = self._enter("cuDeviceGet", ordinal, context=False)
        if err:
            return err, None
        return (OK, ordinal) if 0 <= ordinal < 8 else (CUresult.CUDA_ERROR_INVALID_DEVICE, None)

    def cuDevicePrimaryCtxRetain(self, dev):  # noqa: N802
        err = self._enter("cuDevicePrimaryCtxRetain", dev, context=False)
        if err:
            return err, None
        self.primary_refs[dev] = self.primary_refs.get(dev, 0) + 1
        return OK, PRIMARY + dev

    def cuDevicePrimaryCtxRelease(self, dev):  # noqa: N802
        err = self._enter("cuDevicePrimaryCtxRelease", dev, context=False)
        if err:
            return (err,)
        if not self.primary_refs.get(dev):
            return (CUresult.CUDA_ERROR_INVALID_CONTEXT,)
        self.primary_refs[dev] -= 1
        return (OK,)

    def cuCtxGetCurrent(self):  # noqa: N802
        err = self._enter("cuCtxGetCurrent", context=False)
        if err:
            return err, None
        stack = self._stack()
        return OK, (stack[-1] if stack else 0)

    def cuCtxPushCurrent(self, ctx):  # noqa: N802
        err = self._enter("cuCtxPushCurrent", ctx, context=False)
        if err:
            return (err,)
        self._stack().append(ctx)
        return (OK,)

    def cuCtxPopCurrent(self):  # noqa: N802
        err = self._enter("cuCtxPopCurrent", context=False)
        if err:
            return err, None
        stack = self._stack()
        return (OK, stack.pop()) if stack else (CUresult.CUDA_ERROR_INVALID_CONTEXT, None)

    def cuMemGetAllocationGranularity(self, prop, option):  # noqa: N802
        assert prop.type == "PINNED" and prop.location.type == "DEVICE"
        err = self._enter("cuMemGetAllocationGranularity", option)
        return (err, None) if err else (OK, MIN_GRAN if option == "MIN" else REC_GRAN)

    def cuMemAddressReserve(self, size, alignment, addr, flags):  # noqa: N802
        err = self._enter("cuMemAddressReserve", size, alignment, addr, flags)
        if err:
            return err, None
        if alignment < 0 or alignment & (alignment - 1) or size <= 0 or size % HOST_PAGE:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        align = max(alignment, MIN_GRAN)
        base = -(-self._next_address // align) * align
        self._next_address = base + size + align  # a gap: neighbours never touch
        self.reservations[base] = size
        return OK, base

    def cuMemAddressFree(self, ptr, size):  # noqa: N802
        err = self._enter("cuMemAddressFree", ptr, size)
        if err:
            return (err,)
        if self.reservations.get(ptr) != size or any(ptr <= a < ptr + size for a in self.mappings):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        del self.reservations[ptr]
        return (OK,)

    def cuMemCreate(self, size, prop, flags):  # noqa: N802
        assert prop.location.id == 0
        err = self._enter("cuMemCreate", size, flags)
        if err:
            return err, None
        if size <= 0 or size % MIN_GRAN:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if self.used_bytes() + size > self.device_bytes:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.allocations[handle] = Allocation(size)
        return OK, handle

    def cuMemRelease(self, handle):  # noqa: N802
        err = self._enter("cuMemRelease", handle)
        if err:
            return (err,)
        alloc = self.allocations.get(handle)
        if alloc is None or alloc.refs == 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        alloc.refs -= 1
        self._drop(handle)
        return (OK,)

    def cuMemMap(self, ptr, size, offset, handle, flags):  # noqa: N802
        err = self._enter("cuMemMap", ptr, size, offset, handle, flags)
        if err:
            return (err,)
        alloc = self.allocations.get(handle)
        if (offset != 0 or flags != 0 or ptr % MIN_GRAN or size % MIN_GRAN or alloc is None or alloc.refs == 0
                or alloc.size != size or self._reservation_of(ptr, size) is None or self._overlaps(ptr, size)):
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.mappings[ptr] = (size, handle)
        alloc.maps += 1
        return (OK,)

    def cuMemSetAccess(self, ptr, size, desc, count):  # noqa: N802
        assert count == 1 and desc[0].flags == "RW" and desc[0].location.type == "DEVICE"
        err = self._enter("cuMemSetAccess", ptr, size)
        if err:
            return (err,)
        covered = self._covered(ptr, size)
        if covered is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        self.accessible.update(covered)
        return (OK,)

    def cuMemUnmap(self, ptr, size):  # noqa: N802
        err = self._enter("cuMemUnmap", ptr, size)
        if err:
            return (err,)
        covered = self._covered(ptr, size)
        if covered is None:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        if self._busy(ptr, size):  # a real GPU: the queued kernel faults, the context dies
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        for a in covered:
            _, handle = self.mappings.pop(a)
            self.accessible.discard(a)
            self.allocations[handle].maps -= 1
            self._drop(handle)
        return (OK,)

    def cuMemRetainAllocationHandle(self, addr):  # noqa: N802
        err = self._enter("cuMemRetainAllocationHandle", addr)
        if err:
            return err, None
        if addr not in self.mappings:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        handle = self.mappings[addr][1]
        self.allocations[handle].refs += 1
        return OK, handle

    def _stream(self, stream: int) -> object:
        if stream == LEGACY or (stream == 0 and not self.per_thread_default_stream):
            return "legacy"
        if stream in (0, PER_THREAD):
            return ("per-thread", threading.get_ident())
        return stream

    def cuMemcpyDtoDAsync(self, dst, src, nbytes, stream):  # noqa: N802
        err = self._enter("cuMemcpyDtoDAsync", dst, src, nbytes, stream)
        if err:
            return (err,)
        for a in (dst, src):
            covered = self._covered(a, nbytes, partial_end=True)
            if covered is None or not all(c in self.accessible for c in covered):
                return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        self.copies.append((dst, src, nbytes, self._stream(stream)))
        self.inflight += [(dst, dst + nbytes), (src, src + nbytes)]
        return (OK,)


def fake_hooks(cu: FakeCu, *, stream: int = STREAM) -> TorchHooks:
    """Hooks over ``cu``: waits go to the fake's in-flight work; tensors are meta tensors
    (nothing may read them)."""
    return TorchHooks(
        synchronize=cu.synchronize,
        stream=lambda: stream,
        stream_idle=cu.stream_idle,
        tensor=lambda address, nbytes, owner: torch.empty(nbytes, dtype=torch.uint8, device="meta"),
        total_bytes=lambda: cu.device_bytes,
        free_bytes=lambda: cu.device_bytes - cu.used_bytes(),
    )


def fake_backend(*, create_ahead: int = 4, max_pages: int = 64, cu: FakeCu | None = None,
                 stream: int = STREAM, **kwargs) -> tuple[CudaBackend, FakeCu]:
    """A CudaBackend over a strict FakeCu, built on a thread where torch made the primary
    context current (as ``torch_hooks`` does); ``synchronize`` and ``stream_idle`` are recorded
    among the driver calls."""
    cu = cu or FakeCu()
    cu.make_current()
    backend = CudaBackend("cuda:0", create_ahead=create_ahead, max_pages=max_pages,
                          driver=Driver(0, module=cu), hooks=fake_hooks(cu, stream=stream), **kwargs)
    return backend, cu


def vmm_calls(cu: FakeCu) -> list[tuple]:
    """The recorded calls minus context bookkeeping and idle queries (what most tests compare)."""
    skip = {"cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "stream_idle"}
    return [c for c in cu.calls if c[0] not in skip]


def vmm_names(cu: FakeCu) -> list[str]:
    return [c[0] for c in vmm_calls(cu)]


def assert_nothing_held(cu: FakeCu) -> None:
    """No memory, mapping or reservation left, and every primary-context retain but torch's
    (one per :meth:`FakeCu.make_current`) given back."""
    assert (cu.allocations, cu.mappings, cu.reservations) == ({}, {}, {})
    assert cu.primary_refs.get(0, 0) <= 1, cu.primary_refs

