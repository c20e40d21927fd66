"""The transformers-facing cache: layer groups in layouts over row buffers."""

from .cache import RowSource, VKVCache
from .geometry import GroupGeometry, LayerMismatchError
from .grad import VKVGradientError
from .group import LayerGroup, WindowRollbackError
from .layer import LayerCallError, VKVLayer, VKVSlidingLayer
from .options import CacheOptions
from .row_image import GroupImage
from .stats import CacheStats, GroupStats, PrefillCounts, ReuseReport

__all__ = [
    "CacheOptions", "CacheStats", "GroupGeometry", "GroupImage", "GroupStats", "LayerCallError", "LayerGroup", "LayerMismatchError",
    "PrefillCounts", "ReuseReport", "RowSource", "VKVCache",
    "VKVGradientError", "VKVLayer", "VKVSlidingLayer", "WindowRollbackError",
]
