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
* sharing: ``cuMemExportToShareableHandle`` (POSIX file descriptor type only, flags 0) exports
  only allocations created with that handle type in ``requestedHandleTypes``; the descriptor is
  a real one (a fresh ``memfd``, so it survives ``SCM_RIGHTS``: the allocation is found again by
  the file's inode); ``cuMemImportFromShareableHandle`` of such a descriptor gives a *new* handle
  to the same allocation (of a descriptor that is not open or not an export:
  ``CUDA_ERROR_INVALID_VALUE``). An allocation's memory goes once no handle of it holds a
  reference or a mapping and no descriptor of its exports is open in the process
  (``/proc/self/fd``);
* ``cuMemcpyHtoDAsync`` reads the host bytes at once and stores them in the allocations the
  destination maps (:meth:`FakeCu.read`): what one handle wrote, another handle of the same
  allocation reads; ``cuMemcpyDtoHAsync`` writes those bytes (zeros if never written) to the host
  at once;
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

import ctypes
import enum
import os
import threading
from dataclasses import dataclass, field
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


@dataclass(eq=False)
class Memory:
    """One physical allocation (several handles may name it: an export imported again)."""

    size: int
    shareable: bool = False  # created with CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    contents: bytearray | None = None  # bytes written by cuMemcpyHtoDAsync (None: never written)
    exports: set[tuple[int, int]] = field(default_factory=set)  # (st_dev, st_ino) of its exported files


@dataclass(eq=False)
class Allocation:
    """One handle: its references and mappings, and the memory it names."""

    memory: Memory
    refs: int = 1  # handle references (cuMemCreate's / cuMemImportFromShareableHandle's, cuMemRetainAllocationHandle's)
    maps: int = 0  # addresses it is mapped at

    @property
    def size(self) -> int:
        return self.memory.size


class FakeCu:
    """A strict recording stand-in for ``cuda.bindings.driver`` (the names hf_vkv uses)."""

    CUresult = CUresult
    CUmemAllocationType = SimpleNamespace(CU_MEM_ALLOCATION_TYPE_PINNED="PINNED")
    CUmemAllocationHandleType = SimpleNamespace(CU_MEM_HANDLE_TYPE_NONE="NONE",
                                                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR="POSIX_FD")
    CUdevice_attribute = SimpleNamespace(
        CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED="POSIX_FD_SUPPORTED")
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

    def __init__(self, *, device_bytes: int = 1 << 30, per_thread_default_stream: bool = False,
                 posix_fd_supported: bool = True) -> None:
        self.device_bytes = device_bytes
        self.posix_fd_supported = posix_fd_supported
        self.per_thread_default_stream = per_thread_default_stream
        self.calls: list[tuple] = []
        self.reservations: dict[int, int] = {}  # address -> size
        self.allocations: dict[int, Allocation] = {}  # live handle -> its references, mappings and memory
        self.exports: dict[tuple[int, int], Memory] = {}  # (st_dev, st_ino) of an exported file -> memory
        self.mappings: dict[int, tuple[int, int]] = {}  # address -> (size, handle)
        self.accessible: set[int] = set()  # mapped addresses with access granted
        self.copies: list[tuple[int, int, int, object]] = []  # (dst, src, nbytes, stream it ran on)
        self.host_copies: list[tuple[int, int, int, object]] = []  # (dst, src, nbytes, stream): host<->device
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

    def open_exports(self) -> list[int]:
        """Descriptors open in this process that name an exported allocation."""
        if not self.exports:
            return []
        out = []
        for name in os.listdir("/proc/self/fd"):
            try:
                st = os.fstat(int(name))
            except OSError:  # the listing's own descriptor, closed by now
                continue
            if (st.st_dev, st.st_ino) in self.exports:
                out.append(int(name))
        return out

    def memories(self) -> list[Memory]:
        """Every allocation whose memory is held: by a handle's reference or mapping, or by an open
        descriptor of one of its exports."""
        held = {id(a.memory): a.memory for a in self.allocations.values()}
        for fd in self.open_exports():
            st = os.fstat(fd)
            memory = self.exports[(st.st_dev, st.st_ino)]
            held[id(memory)] = memory
        return list(held.values())

    def used_bytes(self) -> int:
        return sum(m.size for m in self.memories())

    def memory_at(self, address: int) -> Memory:
        """The allocation mapped at ``address`` (the start of a mapping)."""
        return self.allocations[self.mappings[address][1]].memory

    def read(self, address: int, nbytes: int) -> bytes:
        """The bytes written (by ``cuMemcpyHtoDAsync``) into the allocation mapped at ``address``
        (the start of a mapping); zeros where nothing was written."""
        memory = self.memory_at(address)
        data = memory.contents or bytearray(memory.size)
        return bytes(data[:nbytes])

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
            # The handle is gone; its memory goes back to the device once no other handle (an
            # import's) and no open exported descriptor holds it (see memories()).
            del self.allocations[handle]

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

    def cuDeviceGetAttribute(self, attrib, dev):  # noqa: N802
        err = self._enter("cuDeviceGetAttribute", attrib, dev, context=False)
        if err:
            return err, None
        if attrib != "POSIX_FD_SUPPORTED" or not 0 <= dev < 8:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return OK, int(self.posix_fd_supported)

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
        assert prop.requestedHandleTypes in (None, "NONE", "POSIX_FD")
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
        assert prop.location.id == 0 and prop.requestedHandleTypes in (None, "NONE", "POSIX_FD")
        err = self._enter("cuMemCreate", size, flags)
        if err:
            return err, None
        if size <= 0 or size % MIN_GRAN:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if self.used_bytes() + size > self.device_bytes:
            return CUresult.CUDA_ERROR_OUT_OF_MEMORY, None
        shareable = prop.requestedHandleTypes == "POSIX_FD"
        if shareable and not self.posix_fd_supported:
            return CUresult.CUDA_ERROR_NOT_SUPPORTED, None
        return OK, self._new_handle(Memory(size, shareable=shareable))

    def _new_handle(self, memory: Memory) -> int:
        handle, self._next_handle = self._next_handle, self._next_handle + 1
        self.allocations[handle] = Allocation(memory)
        return handle

    def cuMemExportToShareableHandle(self, handle, handleType, flags):  # noqa: N802
        err = self._enter("cuMemExportToShareableHandle", handle, handleType, flags)
        if err:
            return err, None
        alloc = self.allocations.get(handle)
        if alloc is None or alloc.refs == 0 or handleType != "POSIX_FD" or flags != 0:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        if not alloc.memory.shareable:  # not requested at cuMemCreate
            return CUresult.CUDA_ERROR_NOT_SUPPORTED, None
        fd = os.memfd_create("fake-cuda-export", os.MFD_CLOEXEC)
        st = os.fstat(fd)
        self.exports[(st.st_dev, st.st_ino)] = alloc.memory
        alloc.memory.exports.add((st.st_dev, st.st_ino))
        return OK, fd

    def cuMemImportFromShareableHandle(self, osHandle, shHandleType):  # noqa: N802,N803
        err = self._enter("cuMemImportFromShareableHandle", osHandle, shHandleType)
        if err:
            return err, None
        if shHandleType != "POSIX_FD" or not isinstance(osHandle, int):
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        try:
            st = os.fstat(osHandle)
        except OSError:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        memory = self.exports.get((st.st_dev, st.st_ino))
        if memory is None:
            return CUresult.CUDA_ERROR_INVALID_VALUE, None
        return OK, self._new_handle(memory)

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

    def cuMemcpyHtoDAsync(self, dstDevice, srcHost, ByteCount, hStream):  # noqa: N802,N803
        err = self._enter("cuMemcpyHtoDAsync", dstDevice, srcHost, ByteCount, hStream)
        if err:
            return (err,)
        if not isinstance(srcHost, int) or srcHost == 0 or ByteCount <= 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        covered = self._covered(dstDevice, ByteCount, partial_end=True)
        if covered is None or not all(c in self.accessible for c in covered):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        data = ctypes.string_at(srcHost, ByteCount)  # the host bytes, read now
        offset = 0
        for a in covered:
            memory = self.allocations[self.mappings[a][1]].memory
            n = min(memory.size, ByteCount - offset)
            if memory.contents is None:
                memory.contents = bytearray(memory.size)
            memory.contents[:n] = data[offset:offset + n]
            offset += n
        self.host_copies.append((dstDevice, srcHost, ByteCount, self._stream(hStream)))
        self.inflight.append((dstDevice, dstDevice + ByteCount))
        return (OK,)

    def cuMemcpyDtoHAsync(self, dstHost, srcDevice, ByteCount, hStream):  # noqa: N802,N803
        err = self._enter("cuMemcpyDtoHAsync", dstHost, srcDevice, ByteCount, hStream)
        if err:
            return (err,)
        if not isinstance(dstHost, int) or dstHost == 0 or ByteCount <= 0:
            return (CUresult.CUDA_ERROR_INVALID_VALUE,)
        covered = self._covered(srcDevice, ByteCount, partial_end=True)
        if covered is None or not all(c in self.accessible for c in covered):
            return (CUresult.CUDA_ERROR_ILLEGAL_ADDRESS,)
        offset = 0
        for a in covered:
            memory = self.allocations[self.mappings[a][1]].memory
            n = min(memory.size, ByteCount - offset)
            chunk = bytes((memory.contents or bytearray(memory.size))[:n])
            ctypes.memmove(dstHost + offset, chunk, n)  # the host bytes, written now
            offset += n
        self.host_copies.append((dstHost, srcDevice, ByteCount, self._stream(hStream)))
        self.inflight.append((srcDevice, srcDevice + ByteCount))
        return (OK,)

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
                 stream: int = STREAM, shareable: bool = False, **kwargs) -> tuple[CudaBackend, FakeCu]:
    """A CudaBackend over a strict FakeCu, built on a thread where torch made the primary
    context current (as ``torch_hooks`` does); ``synchronize`` and ``stream_idle`` are recorded
    among the driver calls. Two backends over one FakeCu stand for two processes on one device."""
    cu = cu or FakeCu()
    cu.make_current()
    backend = CudaBackend("cuda:0", create_ahead=create_ahead, max_pages=max_pages,
                          driver=Driver(0, module=cu, shareable=shareable), hooks=fake_hooks(cu, stream=stream),
                          shareable=shareable, **kwargs)
    return backend, cu


def vmm_calls(cu: FakeCu) -> list[tuple]:
    """The recorded calls minus context bookkeeping and idle queries (what most tests compare)."""
    skip = {"cuCtxGetCurrent", "cuCtxPushCurrent", "cuCtxPopCurrent", "stream_idle"}
    return [c for c in cu.calls if c[0] not in skip]


def vmm_names(cu: FakeCu) -> list[str]:
    return [c[0] for c in vmm_calls(cu)]


def assert_nothing_held(cu: FakeCu) -> None:
    """No memory, mapping or reservation left, no exported descriptor open, and every
    primary-context retain but torch's (one per :meth:`FakeCu.make_current`) given back."""
    assert (cu.allocations, cu.mappings, cu.reservations) == ({}, {}, {})
    assert cu.open_exports() == [] and cu.used_bytes() == 0
    assert cu.primary_refs.get(0, 0) <= 1, cu.primary_refs

