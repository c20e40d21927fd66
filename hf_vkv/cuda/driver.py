"""The thin layer over CUDA's virtual memory management driver calls (``cuda.bindings.driver``).

Every call goes through :func:`check`, which turns a non-success ``CUresult`` into a
:class:`CudaDriverError` naming the call, the result's name and the driver's description of it.
:class:`Driver` gives the eight VMM calls (granularity, reserve, create, map, set access, unmap,
release, address free), the two sharing calls (export an allocation as a POSIX file descriptor,
import one) and device-to-device, host-to-device and device-to-host copies plain-int signatures. Its only state is the
device's primary context, retained once: every call runs with that context current (pushed on
the calling thread when another, or none, is), because a garbage-collection finalizer or a
DLPack deleter may run on a thread that never made a CUDA runtime call and so has no current
context. The policy (what to map where, when to synchronize) stays in
:class:`~hf_vkv.cuda.vmm_backend.CudaBackend`.

The bindings module is injectable (``Driver(module=...)``): the CPU tests pass a recording fake
with the same names, and nothing here imports ``cuda.bindings`` until :func:`load_bindings` runs.
CuPy has no VMM entry points, so nothing goes through it (``docs/notes/vmm.md`` §1.1).
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from ..memory.errors import BackendError, VKVError

#: Per thread: the context of the innermost :meth:`Driver.current` block open on it (``None``: none).
_INNERMOST = threading.local()

__all__ = ["CU_STREAM_LEGACY", "CudaDriverError", "CudaUnavailableError", "Driver", "INSTALL_HINT", "PageSharingError",
           "check", "load_bindings"]

#: ``CU_STREAM_LEGACY`` of cuda.h (``(CUstream)0x1``): the legacy default stream, whatever the
#: per-thread default stream setting of the bindings. Stream 0 is *not* always that stream:
#: with ``CUDA_PYTHON_CUDA_PER_THREAD_DEFAULT_STREAM=1`` cuda-bindings calls the per-thread
#: variants, where 0 names the calling thread's own default stream.
CU_STREAM_LEGACY = 0x1

#: How to get the driver bindings (named in :class:`CudaUnavailableError`).
INSTALL_HINT = "pip install 'hf_vkv[cuda]'"


class CudaUnavailableError(VKVError, ImportError):
    """The CUDA backend cannot run here: ``cuda-bindings`` is not installed, or no NVIDIA driver
    (``libcuda.so.1``) can be loaded. The message says which and what to do."""


class CudaDriverError(BackendError):
    """A CUDA driver call returned an error.

    ``call`` names the call (``"cuMemCreate"``), ``result`` is the ``CUresult`` name
    (``"CUDA_ERROR_OUT_OF_MEMORY"``) and ``code`` its integer value.
    """

    def __init__(self, call: str, result: str, code: int, description: str) -> None:
        self.result = result
        self.code = code
        super().__init__(call, f"{result} ({code}): {description}")


class PageSharingError(BackendError):
    """Pages cannot be shared across processes as asked: the device or the backend was not made
    for it (``CudaBackend(shareable=True)``), a page to export has no memory or was itself
    imported, or a file descriptor to import is not one an export gave. ``call`` names the
    driver call that was (or would have been) made."""


def load_bindings() -> ModuleType:
    """Import ``cuda.bindings.driver`` (cuda-python 12.6+/13.x), or raise :class:`CudaUnavailableError`
    naming the ``hf_vkv[cuda]`` extra."""
    try:
        return importlib.import_module("cuda.bindings.driver")
    except ImportError as exc:
        raise CudaUnavailableError(
            f"the CUDA backend of hf_vkv needs NVIDIA's driver bindings (cuda-bindings), which are not "
            f"installed ({exc}); install them with {INSTALL_HINT}"
        ) from exc


def _result_name(module: Any, err: Any) -> tuple[str, int]:
    code = int(err)
    name = getattr(err, "name", None)
    if name is None:
        try:
            name = module.CUresult(code).name
        except (ValueError, AttributeError):
            name = "CUresult"
    return str(name), code


def _describe(module: Any, err: Any) -> str:
    """The driver's own sentence for ``err`` (needs the driver; falls back to a placeholder)."""
    try:
        status, text = module.cuGetErrorString(err)
    except Exception:  # noqa: BLE001  (no driver to ask: the name alone must do)
        return "no description (the driver could not be asked)"
    if int(status) != 0 or text is None:
        return "no description"
    return text.decode() if isinstance(text, bytes) else str(text)


def check(call: str, result: Any, *, module: Any) -> Any:
    """Unpack the ``(CUresult, *outputs)`` tuple a binding returns.

    Returns ``None`` for no output, the output for one, a tuple for several; raises
    :class:`CudaDriverError` (naming ``call`` and the error) when the result is not success.
    """
    if not isinstance(result, tuple) or not result:
        raise BackendError(call, f"unexpected return value {result!r} from the driver bindings")
    err, *out = result
    if int(err) != 0:  # CUDA_SUCCESS is 0 in every CUDA version
        name, code = _result_name(module, err)
        raise CudaDriverError(call, name, code, _describe(module, err))
    if not out:
        return None
    return out[0] if len(out) == 1 else tuple(out)


class Driver:
    """The VMM calls for one device, with plain ints for addresses, sizes and handles.

    ``device_index`` is the CUDA ordinal (the ``N`` of ``cuda:N``). Construction runs ``cuInit``
    and builds the allocation properties (pinned device memory on that device) and the read-write
    access descriptor once. A missing driver library surfaces as :class:`CudaUnavailableError`.

    ``shareable``: allocations are created exportable as POSIX file descriptors
    (``requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), so :meth:`export` and
    :meth:`import_handle` work; the device must say it supports that handle type
    (``CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED``), else
    :class:`PageSharingError`. Off by default: no export handle type is requested.
    """

    def __init__(self, device_index: int, *, module: Any | None = None, shareable: bool = False) -> None:
        self.cu = load_bindings() if module is None else module
        self.device_index = device_index
        self.shareable = bool(shareable)
        try:
            self._check("cuInit", self.cu.cuInit(0))
        except CudaDriverError:
            raise
        except (OSError, RuntimeError) as exc:  # cuda.pathfinder's DynamicLibNotFoundError is a RuntimeError
            raise CudaUnavailableError(
                f"the NVIDIA driver library (libcuda.so.1) could not be loaded ({exc}): the CUDA backend needs a "
                f"machine with an NVIDIA GPU and driver; on CPU-only machines keep key/value states on the CPU"
            ) from exc
        cu = self.cu
        prop = cu.CUmemAllocationProp()
        prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        kinds = cu.CUmemAllocationHandleType
        self._fd_type = kinds.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR if shareable else None
        prop.requestedHandleTypes = self._fd_type if shareable else kinds.CU_MEM_HANDLE_TYPE_NONE
        prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        access = cu.CUmemAccessDesc()
        access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = device_index
        access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [access]
        self._device = self._check("cuDeviceGet", cu.cuDeviceGet(device_index))
        self._context = self._check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(self._device))
        self._context_id = int(self._context)
        if shareable:
            try:
                attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED
                supported = self._check("cuDeviceGetAttribute", cu.cuDeviceGetAttribute(attribute, self._device))
                if not int(supported):
                    raise PageSharingError("cuDeviceGetAttribute",
                                           f"device {device_index} does not support POSIX file descriptor handles "
                                           f"(CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED is 0): "
                                           f"its pages cannot be shared across processes; use shareable=False")
            except BaseException:
                self.close()  # the context retained above: a Driver that raises holds nothing
                raise

    def _check(self, call: str, result: Any) -> Any:
        return check(call, result, module=self.cu)

    # ----------------------------------------------------------------------------- context
    @contextmanager
    def current(self) -> Iterator[None]:
        """Run the block with this device's primary context current on the calling thread.

        A block asks the driver which context is current and pushes the primary context only if
        it is not (and pops it after): the thread's own context, if any, is left as it was. A
        block directly inside a block of the same context (any Driver's of that device: the
        thread's innermost block is known) costs nothing; inside another device's block (a
        finalizer of one backend running in another's call) it pushes its own.
        """
        if self._context is None:
            raise CudaDriverError("cuCtxPushCurrent", "CUDA_ERROR_INVALID_CONTEXT", 201,
                                  "this Driver was closed (its primary context released)")
        outer = getattr(_INNERMOST, "context", None)
        if outer == self._context_id:
            yield
            return
        current = self._check("cuCtxGetCurrent", self.cu.cuCtxGetCurrent())
        pushed = current is None or int(current) != self._context_id
        if pushed:
            self._check("cuCtxPushCurrent", self.cu.cuCtxPushCurrent(self._context))
        _INNERMOST.context = self._context_id
        try:
            yield
        finally:
            _INNERMOST.context = outer
            if pushed:
                self._check("cuCtxPopCurrent", self.cu.cuCtxPopCurrent())

    def _call(self, call: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)`` with the primary context current, checked."""
        with self.current():
            return self._check(call, fn(*args))

    def close(self) -> None:
        """Release the primary context retained at construction (idempotent). No call may follow."""
        if self._context is not None:
            self._check("cuDevicePrimaryCtxRelease", self.cu.cuDevicePrimaryCtxRelease(self._device))
            self._context = None

    # ----------------------------------------------------------------------------- queries
    def granularity(self) -> int:
        """Bytes of one physical page: the larger of the minimum and recommended granularities
        (2 MiB on H100/H200; queried, never assumed)."""
        flags = self.cu.CUmemAllocationGranularity_flags
        query = self.cu.cuMemGetAllocationGranularity
        low = self._call("cuMemGetAllocationGranularity", query, self._prop, flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)
        rec = self._call("cuMemGetAllocationGranularity", query, self._prop,
                         flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED)
        return max(int(low), int(rec))

    def driver_version(self) -> int:
        """``cuDriverGetVersion`` (e.g. 13000 for CUDA 13.0)."""
        return int(self._check("cuDriverGetVersion", self.cu.cuDriverGetVersion()))

    # ----------------------------------------------------------------------------- address space
    def reserve(self, nbytes: int, alignment: int) -> int:
        """``cuMemAddressReserve``: ``nbytes`` of virtual address space aligned to ``alignment``
        (the driver wants a power of two, or 0 for its default)."""
        return int(self._call("cuMemAddressReserve", self.cu.cuMemAddressReserve, nbytes, alignment, 0, 0))

    def address_free(self, address: int, nbytes: int) -> None:
        """``cuMemAddressFree`` of exactly one reservation."""
        self._call("cuMemAddressFree", self.cu.cuMemAddressFree, address, nbytes)

    # ----------------------------------------------------------------------------- physical memory
    def create(self, nbytes: int) -> int:
        """``cuMemCreate``: one physical allocation of ``nbytes`` on the device; returns its handle."""
        return int(self._call("cuMemCreate", self.cu.cuMemCreate, nbytes, self._prop, 0))

    def release(self, handle: int) -> None:
        """``cuMemRelease``: the memory goes once no mapping of it remains."""
        self._call("cuMemRelease", self.cu.cuMemRelease, handle)

    # ----------------------------------------------------------------------------- sharing
    def export(self, handle: int) -> int:
        """``cuMemExportToShareableHandle`` as a POSIX file descriptor: a new fd, the caller's to
        close, that refers to the allocation of ``handle`` (an open fd keeps the memory alive).
        Needs ``shareable``: the allocation must have been created with that handle type."""
        if not self.shareable:
            raise PageSharingError("cuMemExportToShareableHandle",
                                   "this driver creates allocations without an export handle type (shareable=False)")
        return int(self._call("cuMemExportToShareableHandle", self.cu.cuMemExportToShareableHandle, handle,
                              self._fd_type, 0))

    def import_handle(self, fd: int) -> int:
        """``cuMemImportFromShareableHandle`` of a POSIX file descriptor an export gave (in this or
        another process): a new handle to the same allocation, released with :meth:`release`.
        ``fd`` stays open: the caller closes it."""
        if not self.shareable:
            raise PageSharingError("cuMemImportFromShareableHandle",
                                   "this driver was made without shareable handles (shareable=False)")
        return int(self._call("cuMemImportFromShareableHandle", self.cu.cuMemImportFromShareableHandle, fd,
                              self._fd_type))

    # ----------------------------------------------------------------------------- mappings
    def map(self, address: int, nbytes: int, handle: int) -> None:
        """``cuMemMap`` of a whole allocation (offset 0, as the driver requires) at ``address``."""
        self._call("cuMemMap", self.cu.cuMemMap, address, nbytes, 0, handle, 0)

    def set_access(self, address: int, nbytes: int) -> None:
        """``cuMemSetAccess``: read-write for this device over a fully mapped range (it may span
        several mappings)."""
        self._call("cuMemSetAccess", self.cu.cuMemSetAccess, address, nbytes, self._access, 1)

    def unmap(self, address: int, nbytes: int) -> None:
        """``cuMemUnmap`` of whole mappings (several adjacent ones at once). No kernel may be using
        the range: the caller synchronizes first."""
        self._call("cuMemUnmap", self.cu.cuMemUnmap, address, nbytes)

    def retain_handle(self, address: int) -> int:
        """``cuMemRetainAllocationHandle``: the handle mapped at ``address`` (one more reference:
        give it back with :meth:`release`). Used by tests to ask the driver what is mapped."""
        return int(self._call("cuMemRetainAllocationHandle", self.cu.cuMemRetainAllocationHandle, address))

    # ----------------------------------------------------------------------------- copies
    def copy_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyDtoDAsync`` on ``stream``, a ``CUstream`` as int as torch reports it: torch's 0
        is the legacy default stream, so 0 is sent as :data:`CU_STREAM_LEGACY` (to the bindings,
        0 may mean the per-thread stream, which is not ordered with torch's work)."""
        self._call("cuMemcpyDtoDAsync", self.cu.cuMemcpyDtoDAsync, dst, src, nbytes, stream or CU_STREAM_LEGACY)

    def copy_from_host_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyHtoDAsync`` of ``nbytes`` from host address ``src`` to device address ``dst``
        on ``stream`` (0 sent as :data:`CU_STREAM_LEGACY`, as in :meth:`copy_async`). The host
        bytes must stay alive and unchanged until the stream has run the copy."""
        self._call("cuMemcpyHtoDAsync", self.cu.cuMemcpyHtoDAsync, dst, src, nbytes, stream or CU_STREAM_LEGACY)

    def copy_to_host_async(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        """``cuMemcpyDtoHAsync`` of ``nbytes`` from device address ``src`` to host address ``dst``
        on ``stream`` (0 sent as :data:`CU_STREAM_LEGACY`); the bytes are there once the stream
        has run the copy."""
        self._call("cuMemcpyDtoHAsync", self.cu.cuMemcpyDtoHAsync, dst, src, nbytes, stream or CU_STREAM_LEGACY)
