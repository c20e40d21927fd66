"""Encoder-decoder models: a VKVCache for the decoder's self-attention, transformers' cache for
the cross-attention (whose keys are computed once from the encoder output)."""

from __future__ import annotations

from transformers.cache_utils import DynamicCache, EncoderDecoderCache

from .cache import VKVCache
from .stats import CacheStats

__all__ = ["VKVEncoderDecoderCache"]


class VKVEncoderDecoderCache(EncoderDecoderCache):
    """``EncoderDecoderCache(VKVCache, DynamicCache)`` whose crop and batch operations work:
    transformers' own class allows them only when both parts are ``DynamicCache`` (assisted and
    prompt-lookup decoding crop the self-attention cache after each round)."""

    def check_dynamic_cache(self, method: str) -> None:
        if not (isinstance(self.self_attention_cache, VKVCache) and isinstance(self.cross_attention_cache, DynamicCache)):
            super().check_dynamic_cache(method)

    def stats(self) -> CacheStats:
        """The decoder's self-attention cache's :meth:`VKVCache.stats` (the cross-attention's
        keys, computed once from the encoder output, stay in transformers' ``DynamicCache``)."""
        return self.self_attention_cache.stats()

    def check_invariants(self) -> None:
        """:meth:`VKVCache.check_invariants` of the decoder's self-attention cache."""
        self.self_attention_cache.check_invariants()

    def reset(self) -> None:
        """Both parts empty, the cross-attention's layers uninitialized, so that the next forward
        may run on another number of rows (prefill once starting again on every row).
        transformers 5.17's ``DynamicLayer.reset`` zeroes its tensors in place and keeps their
        batch (5.24 drops them); this drops them on either."""
        super().reset()
        for layer in self.cross_attention_cache.layers:
            layer.keys = layer.values = None
            layer.is_initialized = False
