"""Registration with transformers, and the one place that patches it.

``import hf_vkv`` calls :func:`register`, which does what this docstring lists and nothing else
(idempotent, no device work; ``docs/notes/transformers.md`` §0, §2). Through transformers' own
registration APIs:

* ``"vkv"`` joins ``generation.configuration_utils.ALL_CACHE_IMPLEMENTATIONS``, which
  ``GenerationConfig.validate`` reads at call time (generate kwargs, ``GenerationConfig``, pipeline
  kwargs, a reloaded ``generation_config.json``);
* the ``"vkv_paged"`` and ``"vkv_cascade"`` attentions and their mask function (sdpa's) in
  ``AttentionInterface`` / ``AttentionMaskInterface`` (:func:`hf_vkv.attention.register_attention`);
* :class:`VKVCache` as a pytree node that refuses to flatten (:mod:`hf_vkv.cache.export`).

And every method of transformers that vkv wraps, each in :func:`patches` (installed by
:func:`_install`, the one wrapper helper; a test fails if anything else in the package patches
transformers):

1. ``GenerationMixin._prepare_cache_for_generation``: for ``"vkv"`` it builds a :class:`VKVCache`
   with :meth:`VKVCache.for_generate` (rows = batch x max(num_beams, num_return_sequences), the
   options of ``cache_config``); an encoder-decoder model gets it as the self-attention part of a
   :class:`~hf_vkv.cache.encoder_decoder.VKVEncoderDecoderCache`. Without it transformers would
   silently build a ``DynamicCache`` for an unknown string. The cache is read and written under
   :func:`cache_kwarg`; a user cache under any of :data:`CACHE_NAMES` together with
   ``cache_implementation="vkv"`` is refused as transformers refuses it;
2. ``GenerationMixin.prepare_inputs_for_generation``: before each forward, a static-layout cache
   maps the pages the step writes (a compiled step cannot run page-table code);
3. ``GenerationMixin._prefill``: with a prefix store in ``cache_config`` rows start from their
   stored prefixes (:mod:`hf_vkv.prefix.reuse`); with a :class:`VKVCache` whose rows repeat
   prompts the prompt's forward runs once per prompt (:mod:`hf_vkv.prefill_once`, which adds
   forward hooks to the model's base module for the length of that one call and removes them);
4. ``GenerationMixin.generate``: after a call with a prefix store, its finished rows go into the
   store (:func:`hf_vkv.prefix.reuse.generate`; without a store it only returns);
5. ``PreTrainedModel.get_correct_attn_implementation``: transformers' validation of an attention
   name (``from_pretrained(..., attn_implementation=...)``, ``Model(config)``,
   ``set_attn_implementation``) refuses ``"vkv_paged"`` for a model it cannot serve, when the
   model is built rather than at its first forward (:mod:`hf_vkv.attention.hooks`);
6. ``PreTrainedModel.set_attn_implementation``: transformers only warns for a model whose
   attention bypasses the attention interface; for ``"vkv_paged"`` every sub-model is checked
   first, so such a model raises instead.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import configuration_utils
from transformers.generation import utils as generation_utils
from transformers.generation.utils import GenerationMixin

from .attention import hooks, register_attention
from .cache import VKVCache
from .cache.encoder_decoder import VKVEncoderDecoderCache
from .cache.options import PREFIX_STORE_KEY, config_dict, from_transformers_keys
from .cache.export import register_pytree

__all__ = ["CACHE_IMPLEMENTATION", "CACHE_NAMES", "PATCH_MARK", "Patch", "cache_kwarg", "patches", "register"]

CACHE_IMPLEMENTATION = "vkv"
#: The names a cache has gone by in ``generate``'s model kwargs and the models' ``forward``
#: (``"cache"`` from transformers 5.24, ``"past_key_values"`` before).
CACHE_NAMES = ("cache", "past_key_values")
#: Attribute marking a method :func:`_install` wrapped (so a second ``register`` wraps nothing).
PATCH_MARK = "_hf_vkv_patch"


def cache_kwarg() -> str:
    """The keyword the running transformers passes the cache under: ``"cache"`` (5.24 and later:
    ``generate``'s ``model_kwargs``, ``prepare_inputs_for_generation``, the models' ``forward`` and
    their outputs) or ``"past_key_values"`` (5.17 - 5.23, deprecated since). Read from
    ``transformers.generation.utils.ALL_CACHE_NAMES``, whose first entry is the default name."""
    names = getattr(generation_utils, "ALL_CACHE_NAMES", None) or ("past_key_values",)
    return "cache" if names[0] == "cache" else "past_key_values"


@dataclass(frozen=True, slots=True)
class Patch:
    """``owner.name`` becomes a method calling ``around(original, self, *args, **kwargs)``."""

    owner: type
    name: str
    around: Callable[..., Any]


def patches() -> tuple[Patch, ...]:
    """Every method of transformers vkv wraps, in the order (and for the reasons) this module's
    docstring gives."""
    from .prefix import reuse  # imported here: it reads CACHE_NAMES and cache_kwarg from this module

    return (
        Patch(GenerationMixin, "_prepare_cache_for_generation", _prepare_cache),
        Patch(GenerationMixin, "prepare_inputs_for_generation", _prepare_inputs),
        Patch(GenerationMixin, "_prefill", reuse.prefill),
        Patch(GenerationMixin, "generate", reuse.generate),
        Patch(PreTrainedModel, "get_correct_attn_implementation", hooks.check_requested_attention),
        Patch(PreTrainedModel, "set_attn_implementation", hooks.check_switched_attention),
    )


def register() -> None:
    """Make ``cache_implementation="vkv"`` and the ``"vkv_paged"`` / ``"vkv_cascade"`` attentions
    work in transformers (safe to call many times)."""
    register_attention()
    register_pytree()
    if CACHE_IMPLEMENTATION not in configuration_utils.ALL_CACHE_IMPLEMENTATIONS:
        configuration_utils.ALL_CACHE_IMPLEMENTATIONS = (
            *configuration_utils.ALL_CACHE_IMPLEMENTATIONS, CACHE_IMPLEMENTATION
        )
    for patch in patches():
        _install(patch)


def _install(patch: Patch) -> None:
    """Replace ``patch.owner.<name>`` by a method calling ``patch.around(original, self, ...)``
    (once: a wrapped method is marked)."""
    original = getattr(patch.owner, patch.name)
    if getattr(original, PATCH_MARK, False):
        return
    around = patch.around

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return around(original, self, *args, **kwargs)

    setattr(method, PATCH_MARK, True)
    setattr(patch.owner, patch.name, method)


def _prepare_inputs(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``prepare_inputs_for_generation``, then :func:`_map_ahead` on what it prepared."""
    model_inputs = original(model, *args, **kwargs)
    _map_ahead(model_inputs)
    return model_inputs


def _map_ahead(model_inputs: Any) -> None:
    """Before each forward of ``generate``: a static-layout cache maps the pages the step writes
    (outside a compiled step, which cannot run page-table code)."""
    past = model_inputs.get(cache_kwarg()) if isinstance(model_inputs, dict) else None
    if isinstance(past, VKVEncoderDecoderCache):
        past = past.self_attention_cache
    if isinstance(past, VKVCache) and past.layout == "static":
        ids = model_inputs.get("input_ids")
        past.map_ahead(ids.shape[-1] if ids is not None else None)


def _prompt_tokens(generation_config: Any, max_cache_length: int) -> int | None:
    """The prompt's tokens: generate sizes the cache ``max_length - 1`` = prompt + new tokens - 1."""
    new = generation_config.max_new_tokens
    return None if new is None else max(max_cache_length + 1 - new, 0)


def _prepare_cache(original: Any, model: Any, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                   batch_size: int, max_cache_length: int, *args: Any, **kwargs: Any) -> Any:
    if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
        if isinstance(generation_config.cache_config, dict) and generation_config.cache_config.get(PREFIX_STORE_KEY) is not None:
            raise ValueError(f"cache_config={{{PREFIX_STORE_KEY!r}: ...}} needs cache_implementation='vkv' (got "
                             f"{generation_config.cache_implementation!r}): add cache_implementation='vkv'")
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)
    given = [name for name in CACHE_NAMES if model_kwargs.get(name) is not None]
    if given:
        past = model_kwargs[given[0]]
        if generation_config.is_assistant and isinstance(past, (VKVCache, VKVEncoderDecoderCache)):
            # assisted decoding: the candidate generator calls the assistant's generate() again with the
            # cache this wrapper built for it in the first round (its config still says "vkv")
            past._is_user_defined = True
            return None
        raise ValueError(
            f"Passing both `cache_implementation` (used to initialize certain caches) and `{given[0]}` (a "
            "Cache object) is unsupported. Please use only one of the two."
        )
    if generation_config.use_cache is False or not model._supports_default_dynamic_cache():
        # transformers warns and ignores the string for models without Cache support
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)
    if not VKVCache.stores_kv(model.config):
        warnings.warn(
            f"cache_implementation='vkv': a {model.config.model_type} model keeps no key/value states that vkv "
            f"stores (its layers hold recurrent or linear-attention state); generating with transformers' default "
            f"cache instead", UserWarning, stacklevel=4)
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    cache_config = from_transformers_keys(config_dict(generation_config.cache_config))  # a string: TypeError; max_cache_len: max_tokens
    from .prefix import reuse  # see patches()

    store, cache_config = reuse.split_prefix_store(cache_config)
    memory = None if store is None else reuse.memory_for(model, store, cache_config)
    if generation_config.compile_config is not None and cache_config.get("layout") is None:
        cache_config["layout"] = "static"  # compiling: the layout StaticLayer's contract holds for
    if cache_config.get("layout") == "static" and cache_config.get("max_tokens") is None:
        # attention reads the whole capacity: StaticCache's, so the same keys (and sums) as it
        cache_config["max_tokens"] = max_cache_length
    cache: Any = VKVCache.for_generate(model, batch_size=batch_size, expand=expand, max_length=max_cache_length + 1,
                                       cache_config=cache_config, num_beams=generation_config.num_beams or 1,
                                       prompt_tokens=_prompt_tokens(generation_config, max_cache_length),
                                       memory_of=memory)
    if store is not None:
        reuse.attach(cache, store, model, num_beams=generation_config.num_beams,
                     eos_token_id=generation_config.eos_token_id)
    if model.config.is_encoder_decoder:
        cache = VKVEncoderDecoderCache(cache, DynamicCache(config=model.config.get_text_config(decoder=True)))
    model_kwargs[cache_kwarg()] = cache
    if generation_config.is_assistant:
        cache.activate_past_recording()
    return None
