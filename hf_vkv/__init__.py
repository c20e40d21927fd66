"""hf_vkv: a virtual-memory KV cache for HuggingFace Transformers.

``import hf_vkv`` registers the ``"vkv"`` cache implementation and the ``"vkv_paged"`` attention
(with its mask function) with transformers and does nothing else (no device work).
"""

from .cache import CacheOptions, CacheStats, LayerCallError, LayerMismatchError, VKVCache, VKVGradientError
from .attention import UnsupportedModelError
from .cache.export import VKVExportError
from .devices import UnsupportedDeviceError
from .memory import (
    Arena,
    BackendError,
    CacheClosedError,
    CapacityError,
    HostBackend,
    InvariantError,
    KVCacheOutOfMemory,
    MappingLimitError,
    PageSizeError,
    VirtualBuffer,
    VKVError,
)
from .prefix import (
    PrefixFileCorruptError,
    PrefixFileError,
    PrefixFormatError,
    PrefixMismatchError,
    PrefixStats,
    PrefixStore,
    load_prefix,
    save_prefix,
)

from .registration import register

__version__ = "0.1.0"

register()

__all__ = [
    "CacheOptions", "CacheStats", "LayerCallError", "LayerMismatchError", "UnsupportedDeviceError", "UnsupportedModelError", "VKVCache", "VKVExportError", "VKVGradientError", "register",
    "Arena", "BackendError", "CacheClosedError", "CapacityError", "HostBackend", "InvariantError",
    "KVCacheOutOfMemory", "MappingLimitError", "PageSizeError", "VKVError", "VirtualBuffer", "__version__",
    "PrefixFileCorruptError", "PrefixFileError", "PrefixFormatError", "PrefixMismatchError", "PrefixStats",
    "PrefixStore", "load_prefix", "save_prefix",
]
