"""Registration with transformers: the ``"vkv"`` cache implementation for ``generate()``.

Two hooks, both idempotent and free of device work (``notes/transformers.md`` §0, §2):

1. ``"vkv"`` is added to ``generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS``, which
   ``GenerationConfig.validate`` reads at call time (generate kwargs, ``GenerationConfig``,
   pipeline kwargs, a reloaded ``generation_config.json``);
2. ``GenerationMixin._prepare_cache_for_generation`` is wrapped: for ``"vkv"`` it builds a
   :class:`VKVCache` sized by the call (rows = batch x max(num_beams, num_return_sequences),
   tokens = max(max_length, max_position_embeddings)) with the options of ``cache_config``.
   Without this wrapper transformers would silently build a ``DynamicCache`` for an unknown string.
"""

from __future__ import annotations

import dataclasses
import functools
import re
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, EncoderDecoderCache
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

from .cache import VKVCache
from .options import CacheOptions

__all__ = ["register", "CACHE_IMPLEMENTATION", "layer_devices_of"]

CACHE_IMPLEMENTATION = "vkv"
_MARK = "_hf_vkv_wrapped"


def register() -> None:
    """Make ``cache_implementation="vkv"`` and ``attn_implementation="vkv_paged"`` work in
    transformers (safe to call many times)."""
    from ..attention.paged import register_attention

    register_attention()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = (
            *configuration_utils.ALL_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION
        )
    original = GenerationMixin._prepare_cache_for_generation
    if not getattr(original, _MARK, False):

        @functools.wraps(original)
        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            return _prepare_cache(original, self, *args, **kwargs)

        setattr(method, _MARK, True)
        GenerationMixin._prepare_cache_for_generation = method  # type: ignore[method-assign]


def _prepare_cache(original: Any, model: Any, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                   batch_size: int, max_cache_length: int, *args: Any, **kwargs: Any) -> Any:
    if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)
    past = model_kwargs.get("past_key_values")
    if past is not None:
        if generation_config.is_assistant and isinstance(past, VKVCache):
            # assisted decoding: the candidate generator calls the assistant's generate() again with the
            # cache this wrapper built for it in the first round (its config still says "vkv")
            past._is_user_defined = True
            return None
        raise ValueError(
            "Passing both `cache_implementation` (used to initialize certain caches) and `past_key_values` (a "
            "Cache object) is unsupported. Please use only one of the two."
        )
    if generation_config.use_cache is False or not model._supports_default_dynamic_cache():
        # transformers warns and ignores the string for models without Cache support
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)
    options = CacheOptions.from_dict(generation_config.cache_config)
    if options.max_tokens is None:
        # Only address space is reserved: room for the model's whole context too, so the returned cache can
        # be passed back to generate() to continue (as a DynamicCache can), and an assistant's cache grows.
        context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 0
        options = dataclasses.replace(options, max_tokens=max(max_cache_length + 1, context))
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    cache: Any = VKVCache(
        model.config, batch_size=batch_size * expand, prompt_repeats=expand, options=options,
        layer_devices=layer_devices_of(model),
    )
    if model.config.is_encoder_decoder:
        cache = EncoderDecoderCache(cache, DynamicCache(config=model.config.get_text_config(decoder=True)))
    model_kwargs["past_key_values"] = cache
    if generation_config.is_assistant:
        cache.activate_past_recording()
    return None


def layer_devices_of(model: Any) -> dict[int, torch.device] | None:
    """Execution device of each decoder layer when accelerate spread them over several devices.

    Offloaded layers ("cpu"/"disk" in ``hf_device_map``) run on the main device, so their KV
    lives there. Returns ``None`` when every layer runs on one device.
    """
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return None
    accelerators = [_device(d) for d in device_map.values() if d not in ("cpu", "disk")]
    main = accelerators[0] if accelerators else torch.device("cpu")
    out: dict[int, torch.device] = {}
    for name, device in device_map.items():
        found = re.search(r"(?:^|\.)layers\.(\d+)(?:\.|$)", name)
        if found:
            out[int(found.group(1))] = main if device in ("cpu", "disk") else _device(device)
    return out if len(set(out.values())) > 1 else None


def _device(name: int | str | torch.device) -> torch.device:
    return torch.device("cuda", name) if isinstance(name, int) else torch.device(name)
