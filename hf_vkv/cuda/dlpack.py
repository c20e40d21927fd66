"""Zero-copy torch tensors over raw device addresses, through a DLPack capsule built with ctypes.

Why DLPack and not ``__cuda_array_interface__``: torch's importer of the CUDA array interface
asks the runtime which device owns the pointer (``cudaPointerGetAttributes``), and a virtual
buffer wraps its whole reservation *before* anything is mapped in it; what the runtime says
about a reserved but unmapped address is not something to rely on. A DLPack tensor names its
device explicitly (``kDLCUDA``, ordinal), so torch builds the tensor without asking. The bytes
travel as ``uint8``; the cache reinterprets them with ``.view(torch.float16 / bfloat16 / ...)``,
so bfloat16 needs no DLPack type code of its own.

:class:`DeviceRange` also exposes ``__cuda_array_interface__`` (``|u1``, version 3) for other
consumers (CuPy, Numba) of a *mapped* range.

Lifetime: the capsule's ``manager_ctx`` is a key into a module-level table that holds the
ctypes structures and the ``owner``; torch calls the deleter when the last view of the tensor
dies, and the deleter drops the entry, so ``owner`` lives exactly as long as the tensor. The
entry is popped under the table's lock and dropped after it is released: dropping ``owner`` may
run its finalizer (a reservation unmapping and freeing its range), which may free another tensor
made here and so re-enter the deleter on the same thread.
"""

from __future__ import annotations

import ctypes
import itertools
import threading

import torch

from ..memory.errors import ArgumentError

__all__ = ["DeviceRange", "KDL_CPU", "KDL_CUDA", "tensor_over"]

KDL_CPU = 1  # DLDeviceType kDLCPU
KDL_CUDA = 2  # DLDeviceType kDLCUDA
_KDL_UINT = 1  # DLDataTypeCode kDLUInt


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    """``DLManagedTensor``; its fields are set below (its deleter takes a pointer to it)."""


_Deleter = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _Deleter)]

_live: dict[int, tuple[object, ...]] = {}  # manager_ctx key -> (struct, shape array, owner)
_live_lock = threading.Lock()
_keys = itertools.count(1)


def _delete(managed: ctypes._Pointer) -> None:  # type: ignore[type-arg]
    # Called by the consumer (torch) when the tensor goes, from whatever thread frees it; ctypes
    # takes the GIL for the callback.
    key = managed.contents.manager_ctx
    with _live_lock:
        entry = _live.pop(int(key or 0), None)
    # Drop the entry (and with it maybe the last reference to ``owner``) outside the lock: the
    # owner's finalizer may free another tensor made here, whose deleter takes the lock again.
    del entry


_DELETER = _Deleter(_delete)  # module lifetime: torch may call it at interpreter shutdown

_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


def live_capsules() -> int:
    """How many exported ranges are still held by a consumer (tests check this drops to 0)."""
    with _live_lock:
        return len(_live)


def tensor_over(address: int, nbytes: int, owner: object, *, device: torch.device) -> torch.Tensor:
    """A ``uint8`` tensor ``[nbytes]`` over ``[address, address + nbytes)`` on ``device`` (CPU or
    CUDA), zero-copy, that keeps ``owner`` alive while it or any view of it lives.

    Nothing is read or written here: the range may be partly unmapped, as long as no kernel
    touches those bytes.
    """
    if nbytes < 0:
        raise ArgumentError(f"nbytes must be >= 0, got {nbytes}")
    if device.type == "cuda":
        dev = _DLDevice(KDL_CUDA, torch.cuda.current_device() if device.index is None else device.index)
    elif device.type == "cpu":
        dev = _DLDevice(KDL_CPU, 0)
    else:
        raise ArgumentError(f"device must be a CPU or CUDA device, got {device}")
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    shape = (ctypes.c_int64 * 1)(nbytes)
    managed = _DLManagedTensor()
    managed.dl_tensor = _DLTensor(address, dev, 1, _DLDataType(_KDL_UINT, 8, 1), shape, None, 0)
    key = next(_keys)
    managed.manager_ctx = key
    managed.deleter = _DELETER
    with _live_lock:
        _live[key] = (managed, shape, owner)
    try:
        capsule = _capsule_new(ctypes.addressof(managed), b"dltensor", None)
        return torch.utils.dlpack.from_dlpack(capsule)
    except BaseException:
        with _live_lock:  # torch did not take it: nobody will call the deleter
            entry = _live.pop(key, None)
        del entry  # outside the lock, as in the deleter
        raise


class DeviceRange:
    """A mapped device range as an array object: ``__cuda_array_interface__`` (``|u1``) for
    consumers such as CuPy or Numba. It holds ``owner``; use it only over mapped bytes."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.address = address
        self.nbytes = nbytes
        self.owner = owner

    @property
    def __cuda_array_interface__(self) -> dict:
        return {"shape": (self.nbytes,), "typestr": "|u1", "data": (self.address, False), "strides": None,
                "version": 3, "stream": None}
