"""Shared pieces of the GPU suite: the skip rule, a fault-injecting CUDA backend, and the
driver-side views of what is mapped (the GPU counterparts of ``tests/conftest.py``'s helpers).

Every test here is marked ``gpu`` and skipped, with the reason, where torch sees no CUDA device
or ``cuda-bindings`` is missing. Run with ``pytest -m gpu tests/gpu`` (see ``docs/gpu.md``).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from conftest import FaultyBackend, snapshot  # tests/conftest.py (tests/ is on sys.path: conftest.py puts it there)

from hf_vkv.memory import VirtualBuffer

HAS_GPU = torch.cuda.is_available()
HAS_BINDINGS = importlib.util.find_spec("cuda") is not None and importlib.util.find_spec("cuda.bindings") is not None

#: Apply to every GPU test module: ``pytestmark = GPU``.
GPU = [
    pytest.mark.gpu,
    pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
    pytest.mark.skipif(not HAS_BINDINGS, reason="needs cuda-bindings: pip install 'hf_vkv[cuda]'"),
]


def cuda_backend(**kwargs):
    """A CudaBackend on the current device (imported lazily: the module imports on CPU too)."""
    from hf_vkv.cuda import CudaBackend

    return CudaBackend(torch.device("cuda", torch.cuda.current_device()), **kwargs)


class FaultyCudaBackend(FaultyBackend):
    """``tests/conftest.py``'s ``FaultyBackend`` around a :class:`~hf_vkv.cuda.CudaBackend` (so the
    state machine of ``tests/stateful/test_state_machine.py`` runs on it). ``page_bytes`` must be the
    device's granularity (the state machine is run with its ``PAGE`` set to it);
    ``create_ahead=1`` keeps no spare handles, so ``resident_bytes()`` counts pages only."""

    def __init__(self, *, page_bytes: int, name: str = "hf_vkv-gpu-test") -> None:
        super().__init__(page_bytes=page_bytes, name=name,
                         inner=cuda_backend(page_bytes=page_bytes, create_ahead=1, max_pages=256))


def _inner(buf: VirtualBuffer):
    backend = buf.store.backend
    return getattr(backend, "inner", backend)


def driver_mapped_pages(buf: VirtualBuffer) -> dict[tuple[int, int], int]:
    """``{(row, slot): page}`` as the *driver* sees it: for every page slot of ``buf``'s
    reservation, ``cuMemRetainAllocationHandle`` says which allocation is mapped there (or fails:
    nothing is); the handle is translated back to the backend's page id."""
    from hf_vkv.cuda import CudaDriverError

    backend = _inner(buf)
    by_handle = {backend.handle(p): int(p) for p in backend._slot_of}
    page = backend.page_bytes
    out: dict[tuple[int, int], int] = {}
    for r in range(buf.rows):
        for s in range(buf.row_stride // page):
            address = buf.address + r * buf.row_stride + s * page
            try:
                handle = backend._driver.retain_handle(address)
            except CudaDriverError:
                continue
            backend._driver.release(handle)  # retain took a reference
            out[(r, s)] = by_handle.get(handle, -handle)
    return out


def expected_mapped_pages(buf: VirtualBuffer) -> dict[tuple[int, int], int]:
    return {(r, row.start + k): int(p) for r, row in enumerate(buf.table) for k, p in enumerate(row.pages)}


def check_mapped_pages(*bufs: VirtualBuffer) -> None:
    """The driver maps exactly what the page tables say (the GPU ``mapped_pages`` fixture)."""
    for buf in bufs:
        expected = expected_mapped_pages(buf)
        backend = _inner(buf)
        lo, hi = buf.address, buf.address + buf.rows * buf.row_stride
        recorded = {((a - lo) // buf.row_stride, (a - lo) % buf.row_stride // backend.page_bytes): int(p)
                    for a, p in backend.mapped().items() if lo <= a < hi}
        assert recorded == expected
        assert driver_mapped_pages(buf) == expected


def gpu_snapshot(*bufs: VirtualBuffer, id_space: bool = True) -> dict:
    """``tests/conftest.py``'s ``snapshot`` with the mappings read from the driver."""
    return snapshot(*bufs, id_space=id_space, mapped=driver_mapped_pages)
