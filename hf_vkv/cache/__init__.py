"""The transformers-facing cache: layer groups in layouts over row buffers."""

from .cache import VKVCache
from .geometry import GroupGeometry, LayerMismatchError
from .grad import VKVGradientError
from .group import LayerGroup
from .layer import LayerCallError, VKVLayer, VKVSlidingLayer
from .options import CacheOptions
from .stats import CacheStats, GroupStats

__all__ = [
    "CacheOptions", "CacheStats", "GroupGeometry", "GroupStats", "LayerCallError", "LayerGroup", "LayerMismatchError", "VKVCache",
    "VKVGradientError", "VKVLayer", "VKVSlidingLayer",
]
