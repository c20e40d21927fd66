"""The names vkv and transformers' generation agree on (a leaf: imports nothing of the wing)."""

from __future__ import annotations

from transformers.generation import utils as generation_utils

__all__ = ["CACHE_IMPLEMENTATION", "CACHE_NAMES", "cache_kwarg"]

CACHE_IMPLEMENTATION = "vkv"
#: The names a cache has gone by in ``generate``'s model kwargs and the models' ``forward``
#: (``"cache"`` from transformers 5.24, ``"past_key_values"`` before).
CACHE_NAMES = ("cache", "past_key_values")


def cache_kwarg() -> str:
    """The keyword the running transformers passes the cache under: ``"cache"`` (5.24 and later:
    ``generate``'s ``model_kwargs``, ``prepare_inputs_for_generation``, the models' ``forward`` and
    their outputs) or ``"past_key_values"`` (5.17 - 5.23, deprecated since). Read from
    ``transformers.generation.utils.ALL_CACHE_NAMES``, whose first entry is the default name."""
    names = getattr(generation_utils, "ALL_CACHE_NAMES", None) or ("past_key_values",)
    return "cache" if names[0] == "cache" else "past_key_values"
