"""The transformers-facing cache: layer groups over virtual buffers, and registration."""

from .cache import CacheStats, GroupStats, UnsupportedDeviceError, VKVCache
from .group import LayerGroup, LayerMismatchError
from .layer import VKVLayer, VKVSlidingLayer
from .options import CacheOptions
from .registration import register

__all__ = [
    "CacheOptions", "CacheStats", "GroupStats", "LayerGroup", "LayerMismatchError", "UnsupportedDeviceError",
    "VKVCache", "VKVLayer", "VKVSlidingLayer", "register",
]
