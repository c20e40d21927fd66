"""The CUDA backend: device pages through the driver's virtual memory management.

Importing this package imports torch and ctypes only; ``cuda.bindings`` is loaded when a
:class:`Driver` is made (``pip install 'hf_vkv[cuda]'``).
"""

from .driver import (CU_STREAM_LEGACY, INSTALL_HINT, CudaDriverError, CudaUnavailableError, Driver,
                     PageSharingError, check, load_bindings)
from .hooks import TorchHooks, torch_hooks
from .vmm_backend import CudaBackend, recv_page_fds, send_page_fds

__all__ = [
    "CU_STREAM_LEGACY", "CudaBackend", "CudaDriverError", "CudaUnavailableError", "Driver",
    "INSTALL_HINT", "PageSharingError", "TorchHooks", "check", "load_bindings", "recv_page_fds", "send_page_fds",
    "torch_hooks",
]
