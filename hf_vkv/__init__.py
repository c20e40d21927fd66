"""hf_vkv: a virtual-memory KV cache for HuggingFace Transformers.

``import hf_vkv`` registers the ``"vkv"`` cache implementation and the ``"vkv_paged"`` and
``"vkv_cascade"`` attentions (with their mask function) with transformers and does nothing else
(no device work).

The public surface is what a user needs: the cache, its options and stats, the prefix store and
prefix files, the A/B harness's :func:`run_ab` (imported when first used), and the errors. The
machinery stays importable from its modules (``hf_vkv.memory``, ``hf_vkv.cache``, ...).
"""

from typing import Any

from .attention import UnsupportedModelError
from .cache import CacheOptions, CacheStats, LayerCallError, LayerMismatchError, ReuseReport, VKVCache, VKVGradientError
from .cache.export import VKVExportError
from .cache.group import WindowRollbackError
from .cache.hybrid import RecurrentRollbackError
from .devices import UnsupportedDeviceError
from .memory.process import ForkedMemoryError
from .memory import (
    BackendError,
    CacheClosedError,
    CapacityError,
    InvariantError,
    KVCacheOutOfMemory,
    MappingLimitError,
    PageSizeError,
    VKVError,
)
from .memory.errors import (
    ArgumentError,
    ArgumentTypeError,
    CacheIndexError,
    CompiledModuleError,
    CacheOptionError,
    CacheOptionTypeError,
    MissingDependencyError,
)
from .prefix import (
    PrefixFileCorruptError,
    PrefixFileError,
    PrefixFormatError,
    PrefixMismatchError,
    PrefixPathError,
    PrefixStats,
    PrefixStore,
    load_prefix,
    save_prefix,
)
from .generate import register, reuse_report

from .version import __version__

register()

__all__ = [
    # the cache
    "VKVCache", "CacheOptions", "CacheStats",
    # prefixes across calls
    "PrefixStore", "PrefixStats", "ReuseReport", "reuse_report", "save_prefix", "load_prefix",
    # checking it against DynamicCache
    "run_ab",
    # errors
    "VKVError", "ArgumentError", "ArgumentTypeError", "CacheIndexError", "CompiledModuleError", "CacheOptionError", "CacheOptionTypeError",
    "MissingDependencyError", "KVCacheOutOfMemory", "MappingLimitError", "CapacityError",
    "PageSizeError", "CacheClosedError", "ForkedMemoryError", "BackendError", "InvariantError", "LayerMismatchError", "LayerCallError",
    "VKVGradientError", "VKVExportError", "RecurrentRollbackError", "WindowRollbackError", "UnsupportedModelError", "UnsupportedDeviceError",
    "PrefixFileError", "PrefixFileCorruptError", "PrefixFormatError", "PrefixMismatchError", "PrefixPathError",
    # registration (done on import; idempotent)
    "register", "__version__",
]


def __getattr__(name: str) -> Any:
    """``hf_vkv.run_ab``: the A/B harness is imported when first asked for, not by ``import hf_vkv``."""
    if name == "run_ab":
        from .ab import run_ab

        return run_ab
    raise AttributeError(f"module 'hf_vkv' has no attribute {name!r}")
