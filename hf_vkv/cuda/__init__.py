"""The CUDA backend: device pages through the driver's virtual memory management.

Importing this package imports torch and ctypes only; ``cuda.bindings`` is loaded when a
:class:`Driver` is made (``pip install 'hf_vkv[cuda]'``).
"""

from .backend import DEFAULT_CREATE_AHEAD, CudaBackend
from .driver import INSTALL_HINT, CudaDriverError, CudaUnavailableError, Driver, check, load_bindings
from .hooks import TorchHooks, torch_hooks

__all__ = [
    "CudaBackend", "CudaDriverError", "CudaUnavailableError", "DEFAULT_CREATE_AHEAD", "Driver", "INSTALL_HINT",
    "TorchHooks", "check", "load_bindings", "torch_hooks",
]
