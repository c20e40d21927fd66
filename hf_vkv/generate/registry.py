"""The one place that patches transformers, and registration with it.

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
transformers). A ``generate`` call's state travels in one record,
:class:`~hf_vkv.generate.call.GenerateCall`, which the first hook puts on the cache it builds and
the others read from the cache transformers hands them (never from module state):

0. ``GenerationMixin.generate``: the call runs with Ctrl-C held wherever hf_vkv's bookkeeping is
   half done (a pool transaction, a prefix store's change, a finalizer giving a dropped cache's
   pages back, prefill once's hooks going on or off), and raised as that ends
   (:mod:`hf_vkv.memory.interrupts`): an interrupt stops the call within a layer and leaves no
   page, hook or transaction behind;
1. ``GenerationMixin._prepare_cache_for_generation``: for ``"vkv"`` it builds a :class:`VKVCache`
   with :meth:`VKVCache.for_generate` (rows = batch x max(num_beams, num_return_sequences), the
   options of ``cache_config``, the layout :func:`hf_vkv.devices.choose_layout` picks for the
   call) and the call's record; with a prefix store in ``cache_config`` the cache draws from the
   store's memory (:mod:`hf_vkv.generate.reuse`). An encoder-decoder model gets it as the
   self-attention part of a :class:`~hf_vkv.cache.encoder_decoder.VKVEncoderDecoderCache`. Without
   it transformers would silently build a ``DynamicCache`` for an unknown string. A user cache
   under any of :data:`CACHE_NAMES` together with ``cache_implementation="vkv"`` is refused as
   transformers refuses it;
2. ``GenerationMixin.prepare_inputs_for_generation``: before each forward, a static-layout cache
   maps the pages the step writes (a compiled step cannot run page-table code);
3. ``GenerationMixin._prefill``: a decoder's vkv cache passed with no more ``input_ids`` than it
   holds (the new tokens without the history) raises :class:`ArgumentError` before any forward;
   with a prefix store, rows start from their stored prefixes
   (:func:`hf_vkv.generate.reuse.start`); with a :class:`VKVCache` whose rows repeat prompts the
   prompt's forward runs once per prompt (:mod:`hf_vkv.generate.prefill_once`, which adds forward
   hooks to the model's base module for the length of that one call and removes them);
4. ``GenerationMixin._sample``, ``_beam_search`` and ``_assisted_decoding`` (the decoding loops
   ``generate`` dispatches to, by name, in 5.17 - 5.24): when the loop returns, the cache checks
   that the last forward's attention got what its layers returned (:meth:`VKVCache.check_reads`),
   and a call with a prefix store inserts its finished rows (:func:`hf_vkv.generate.reuse.finish`);
   however it ends, the record leaves the cache, and a cache the call built is closed if the loop
   raised (its pages go back at once: an interrupted call holds nothing);
5. ``PreTrainedModel.get_correct_attn_implementation``: transformers' validation of an attention
   name (``from_pretrained(..., attn_implementation=...)``, ``Model(config)``,
   ``set_attn_implementation``) refuses ``"vkv_paged"`` for a model it cannot serve, when the
   model is built rather than at its first forward (:mod:`hf_vkv.attention.hooks`);
6. ``PreTrainedModel.set_attn_implementation``: transformers only warns for a model whose
   attention bypasses the attention interface; for ``"vkv_paged"`` every sub-model is checked
   first, so such a model raises instead;
7. ``GenerationConfig.to_json_string``: a generation config whose ``cache_config`` holds a
   :class:`~hf_vkv.PrefixStore` (memory of this process, which JSON cannot hold) is written
   without it, with a warning naming ``store.save``; it raised ``TypeError`` inside
   ``save_pretrained``, leaving a folder without weights. Compared and shown (``==``, ``hash``,
   ``repr``), it names the store by its identity, without a warning.

:func:`register_serving` (called by ``hf-vkv serve``, not by ``import hf_vkv``: it imports
transformers' server, an extra, 5.25 or later) adds :func:`serving_patches`:

8. ``EngineClient.run_engine`` of ``transformers.cli.serving.model_manager`` (a static method: what
   the process transformers spawns for each model runs) becomes :func:`run_engine` itself, not a wrapper: the spawned process unpickles
   it by name, so it imports hf_vkv, installs :func:`engine_patches`, and runs transformers' engine,
   whose model gets its prefix store as it loads (``Patch.spawned``);
9. ``transformers.cli.serving.server.build_server`` (a function of that module): the app it builds
   answers ``GET /v1/vkv/stores`` with each running model's store, and a refused request (an HTTP
   400) in OpenAI's error shape too, which OpenAI clients show (:func:`hf_vkv.generate.serving.extend_app`);
10. ``run_until_parent_exits`` of ``transformers.cli.serving.utils`` (what every process the server
   spawns runs first: the API servers of ``--api-server-count`` N > 1, each building its own app,
   and each model's) becomes :func:`run_spawned` itself (``Patch.spawned``), under both names
   transformers calls it by (``utils``'s and ``model_manager``'s: a spawned target is pickled by its
   module's name, which must be the function pickled): such a process imports hf_vkv and installs
   these patches before it builds an app, so every API server has item 9's route and errors.

and in each model's process :func:`register_engine` adds :func:`engine_patches`:

11. ``GenerateRunner.generate`` of ``transformers.cli.serving.utils`` (the server's default path, one
   ``model.generate()`` per request): the request's keywords generate with vkv and the model's
   prefix store, or the request is refused before it is queued (:mod:`hf_vkv.generate.serving`);
12. ``GenerationMixin.generate`` (around item 0's wrapper): an hf_vkv error raised while a request
    generates leaves as a :class:`~hf_vkv.generate.serving.ServedRequestError` (a ``ValueError``
    naming it), which the server answers with an HTTP 400 rather than an error without its message.
"""

from __future__ import annotations

import copy
import functools
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from transformers import PreTrainedModel
from transformers.cache_utils import DynamicCache
from transformers.generation import configuration_utils
from transformers.generation.utils import GenerationMixin

from ..attention import PAGED_ATTENTION, hooks, register_attention
from ..cache import VKVCache
from ..cache.encoder_decoder import VKVEncoderDecoderCache
from ..cache.export import register_pytree
from ..cache.options import PAGED_KEYS, PREFIX_STORE_KEY, config_dict, from_transformers_keys
from ..memory.errors import (ArgumentError, CacheOptionError, CapacityError, CompiledModuleError, KVCacheOutOfMemory,
                             MissingDependencyError, VKVError)
from ..memory import guarded, section
from ..memory.map_budget import MappingLimitError
from . import prefill_once, reuse, serving
from .call import begin, end
from .names import CACHE_IMPLEMENTATION, CACHE_NAMES, cache_kwarg

__all__ = ["CACHE_IMPLEMENTATION", "CACHE_NAMES", "PATCH_MARK", "Patch", "cache_kwarg", "engine_patches", "patches",
           "register", "register_engine", "register_serving", "run_engine", "run_spawned", "serving_patches"]

#: Attribute naming the ``around`` of a method :func:`_install` wrapped (so a second ``register`` wraps nothing).
PATCH_MARK = "_hf_vkv_patch"
#: ``generate``'s decoding loops (``GENERATION_MODES_MAPPING``'s values that are methods).
DECODING_LOOPS = ("_sample", "_beam_search", "_assisted_decoding")


@dataclass(frozen=True, slots=True)
class Patch:
    """``owner.name`` becomes a method calling ``around(original, self, *args, **kwargs)``."""

    owner: Any  # a class (or a module: its function is patched the same way)
    name: str
    around: Callable[..., Any]
    #: ``owner.name`` is a static method (or a module's function) that a spawned process runs: it
    #: becomes ``around`` itself (a module-level function, pickled by its name), which finds the
    #: original as ``around.original``
    spawned: bool = False


def patches() -> tuple[Patch, ...]:
    """Every method of transformers vkv wraps, in the order (and for the reasons) this module's
    docstring gives."""
    return (
        Patch(GenerationMixin, "generate", _guarded_generate),
        Patch(GenerationMixin, "_prepare_cache_for_generation", _prepare_cache),
        Patch(GenerationMixin, "prepare_inputs_for_generation", _prepare_inputs),
        Patch(GenerationMixin, "_prefill", _prefill),
        *(Patch(GenerationMixin, name, _decoding_loop) for name in DECODING_LOOPS if hasattr(GenerationMixin, name)),
        Patch(PreTrainedModel, "get_correct_attn_implementation", hooks.check_requested_attention),
        Patch(PreTrainedModel, "set_attn_implementation", hooks.check_switched_attention),
        Patch(configuration_utils.GenerationConfig, "to_json_string", _json_without_store),
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


def serving_patches() -> tuple[Patch, ...]:
    """The parts of transformers' server vkv patches in the server's processes (items 8 to 10 of this
    module's docstring); imports the server, which needs ``pip install "hf_vkv[serve]"``."""
    try:
        from transformers.cli.serving import model_manager, server, utils
        from transformers.cli.serving.model_manager import EngineClient
        from transformers.cli.serving.utils import GenerateRunner, run_until_parent_exits  # noqa: F401 - checked
    except ImportError as exc:
        import transformers

        if not (exc.name or "").startswith("transformers"):  # the extra's packages (fastapi, uvicorn, ...)
            raise MissingDependencyError('hf-vkv serve needs transformers\' server (transformers >= 5.25 with its '
                                         'serving extra): pip install "hf_vkv[serve]"', name=exc.name) from exc
        raise MissingDependencyError(  # a server of another shape than 5.25's
            f"hf-vkv serve runs transformers' server as 5.25 shapes it (EngineClient.run_engine, GenerateRunner."
            f"generate), which transformers {transformers.__version__} does not have ({exc}): pip install "
            f"\"hf_vkv[serve]\" (transformers[serving] >= 5.25)", name=exc.name) from exc
    return (Patch(EngineClient, "run_engine", run_engine, spawned=True),
            Patch(server, "build_server", _serve_app),
            *(Patch(module, "run_until_parent_exits", run_spawned, spawned=True) for module in (utils, model_manager)))


def engine_patches() -> tuple[Patch, ...]:
    """What a model's process of transformers' server patches (items 10 and 11)."""
    from transformers.cli.serving.utils import GenerateRunner

    return (Patch(GenerateRunner, "generate", _serve_request), Patch(GenerationMixin, "generate", _served_generate))


def register_serving() -> None:
    """:func:`register`, and transformers' server generating with vkv (safe to call many times)."""
    register()
    for patch in serving_patches():
        _install(patch)


def register_engine() -> None:
    """:func:`register`, and a model's process of transformers' server generating with vkv (safe to
    call many times)."""
    register()
    for patch in engine_patches():
        _install(patch)


def run_engine(load: Any, generation_state: Any, *rest: Any) -> None:
    """``EngineClient.run_engine`` in the model's process that transformers' server spawns (a
    function of hf_vkv's, so the process imports hf_vkv to run it): the engine's patches
    (:func:`register_engine`), then transformers' own engine, whose model,
    once loaded, gets its prefix store (:func:`serving.store_of`) unless the continuous-batching path serves
    it. ``run_engine.original`` is transformers' function where this process patched it."""
    from transformers.cli.serving.model_manager import EngineClient

    register_engine()

    def load_with_store(*args: Any, **kwargs: Any) -> Any:
        model, processor = load(*args, **kwargs)
        if not generation_state.use_continuous_batching(model.config, processor):
            serving.store_of(model)
        return model, processor

    original = getattr(run_engine, "original", None) or EngineClient.run_engine
    original(load_with_store, generation_state, *rest)


def run_spawned(target: Any, *args: Any) -> None:
    """``run_until_parent_exits`` in a process transformers' server spawns (an API server of
    ``--api-server-count``, a model's process): :func:`register_serving` in that process, so an app
    it builds has vkv's route and errors, then transformers' function. ``run_spawned.original`` is
    transformers' function where this process patched it."""
    from transformers.cli.serving import utils

    register_serving()
    original = getattr(run_spawned, "original", None) or utils.run_until_parent_exits
    original(target, *args)


def _install(patch: Patch) -> None:
    """Replace ``patch.owner.<name>`` by a method calling ``patch.around(original, self, ...)``
    (once: a wrapped method is marked)."""
    original = getattr(patch.owner, patch.name)
    around = patch.around
    if _wrapped_by(original, around):
        return
    if patch.spawned:
        around.original = original  # type: ignore[attr-defined] - this process's; a spawned one has its own
        setattr(around, PATCH_MARK, around)
        setattr(patch.owner, patch.name, staticmethod(around) if isinstance(patch.owner, type) else around)
        return

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        return around(original, self, *args, **kwargs)

    setattr(method, PATCH_MARK, around)
    setattr(patch.owner, patch.name, method)


def _wrapped_by(method: Any, around: Callable[..., Any]) -> bool:
    """Whether ``around`` wraps ``method`` already, at any depth (a model's process of the server
    wraps ``generate`` twice: :func:`_guarded_generate`, then :func:`_served_generate`)."""
    while method is not None:
        if getattr(method, PATCH_MARK, None) is around:
            return True
        method = getattr(method, "__wrapped__", None)
    return False


def _guarded_generate(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``generate`` with Ctrl-C held while hf_vkv's bookkeeping is half done
    (:mod:`hf_vkv.memory.interrupts`), up to its return: the caches it drops are given back inside."""
    with guarded():
        return original(model, *args, **kwargs)


def _json_without_store(original: Any, config: Any, *args: Any, **kwargs: Any) -> str:
    """``GenerationConfig.to_json_string`` of ``config`` without a prefix store in its
    ``cache_config`` (a copy of the config is written; ``config`` keeps its store), with a warning.
    With ``ignore_metadata=True``, the string transformers compares and shows a config by
    (``==``, ``hash``, ``repr``), the store is named by its identity instead, without a warning:
    nothing is written, and configs holding other stores differ."""
    options = config.cache_config
    if not isinstance(options, dict) or options.get(PREFIX_STORE_KEY) is None:
        return original(config, *args, **kwargs)
    written = copy.copy(config)
    written.cache_config = {k: v for k, v in options.items() if k != PREFIX_STORE_KEY}
    if kwargs.get("ignore_metadata"):
        store = options[PREFIX_STORE_KEY]
        written.cache_config[PREFIX_STORE_KEY] = f"<{type(store).__name__} at {id(store):#x}: not saved>"
    else:
        warnings.warn(f"the generation config's cache_config holds a PrefixStore (memory of this process): it is "
                      f"written without it; store.save(folder, model=model) saves its entries, PrefixStore.load("
                      f"folder, model=model) reads them back", UserWarning, stacklevel=3)
    return original(written, *args, **kwargs)


def _prepare_inputs(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``prepare_inputs_for_generation``, then :func:`_map_ahead` on what it prepared."""
    model_inputs = original(model, *args, **kwargs)
    _map_ahead(model_inputs)
    return model_inputs


#: Devices on which transformers compiles a ``generate`` call's step given a ``compile_config``
#: (``GenerationMixin._valid_auto_compile_criteria``, 5.17 - 5.24); elsewhere only where the config
#: says ``_compile_all_devices``.
_COMPILING_DEVICES = ("cuda", "xpu", "neuron", "tpu")


def _compiles(model: Any, generation_config: Any) -> bool:
    """Whether transformers will compile this call's decoding step, so that the cache must be
    static (``compile_config`` set, compiling not disabled, a device it compiles on): on the CPU a
    plain ``compile_config`` compiles nothing and generates with an eager step, so the call keeps
    the default layout and computes as DynamicCache, not as StaticCache."""
    config = generation_config.compile_config
    if config is None or getattr(generation_config, "disable_compile", False):
        return False
    return model.device.type in _COMPILING_DEVICES or bool(getattr(config, "_compile_all_devices", False))


def _store_of_the_model(model: Any, generation_config: Any) -> bool:
    """Whether the call's prefix store is the one in ``model.generation_config`` (merged into every
    call's config) while the call names another cache than that config does."""
    own = getattr(model, "generation_config", None)
    options = getattr(own, "cache_config", None)
    return isinstance(options, dict) and options.get(PREFIX_STORE_KEY) is generation_config.cache_config.get(
        PREFIX_STORE_KEY) and own.cache_implementation != generation_config.cache_implementation


def _map_ahead(model_inputs: Any) -> None:
    """Before each forward of ``generate``: a static-layout cache maps the pages the step writes
    (outside a compiled step, which cannot run page-table code)."""
    past = model_inputs.get(cache_kwarg()) if isinstance(model_inputs, dict) else None
    if isinstance(past, VKVEncoderDecoderCache):
        past = past.self_attention_cache
    if isinstance(past, VKVCache) and past.layout == "static":
        ids = model_inputs.get("input_ids")
        past.map_ahead(ids.shape[-1] if ids is not None else None)


def _prepare_cache(original: Any, model: Any, generation_config: Any, model_kwargs: dict, generation_mode: Any,
                   batch_size: int, max_cache_length: int, *args: Any, **kwargs: Any) -> Any:
    def transformers_own() -> Any:
        return original(model, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length,
                        *args, **kwargs)

    store_given = isinstance(generation_config.cache_config, dict) \
        and generation_config.cache_config.get(PREFIX_STORE_KEY) is not None
    if generation_config.cache_implementation != CACHE_IMPLEMENTATION:
        if store_given and (generation_config.is_assistant or _store_of_the_model(model, generation_config)):
            # an assistant model's generate gets a copy of the main call's config with its cache
            # implementation unset (it keeps its own cache): the store is the main model's; and a
            # call naming another cache than the model's config, whose store is for vkv, gets that
            # cache as transformers builds it (the call's choice wins): both without the store
            generation_config.cache_config = {k: v for k, v in generation_config.cache_config.items()
                                              if k != PREFIX_STORE_KEY}
        elif store_given:
            raise CacheOptionError(
                f"cache_config={{{PREFIX_STORE_KEY!r}: ...}} needs cache_implementation='vkv' (got "
                f"{generation_config.cache_implementation!r}): add cache_implementation='vkv'")
        passed = prefill_once.vkv_cache_of(model_kwargs, wrapped=True)
        if passed is not None:  # a vkv cache given to generate: what it cannot serve, before anything runs
            _check_compiled(model)
            _check_layers(model, passed[1])
            _check_room(passed[1], generation_config, max_cache_length)
        return transformers_own()
    given = [name for name in CACHE_NAMES if model_kwargs.get(name) is not None]
    if given:
        past = model_kwargs[given[0]]
        if generation_config.is_assistant and isinstance(past, (VKVCache, VKVEncoderDecoderCache)):
            # assisted decoding: the candidate generator calls the assistant's generate() again with the
            # cache this wrapper built for it in the first round (its config still says "vkv")
            past._is_user_defined = True
            return None
        inherited = getattr(getattr(model, "generation_config", None), "cache_implementation", None)
        raise ArgumentError(
            f"Passing both `cache_implementation` (used to initialize certain caches) and `{given[0]}` (a "
            "Cache object) is unsupported. Please use only one of the two."
            + (f" Here cache_implementation={CACHE_IMPLEMENTATION!r} is set on model.generation_config, which every "
               f"call inherits: to continue the cache you pass, add cache_implementation=None to this call "
               f"(nothing was computed; the cache is as it was)" if inherited == CACHE_IMPLEMENTATION else ""))
    if generation_config.use_cache is False:
        return transformers_own()
    _check_compiled(model)
    if not model._supports_default_dynamic_cache():  # transformers logs that it ignores the string
        warnings.warn(
            f"cache_implementation='vkv': a {model.config.model_type} model's generate takes no Cache object (it "
            f"builds its own); generating with it, without vkv"
            + (", and without the prefix store given in cache_config" if store_given else ""),
            UserWarning, stacklevel=4)
        return transformers_own()
    if not VKVCache.stores_kv(model.config):
        warnings.warn(
            f"cache_implementation='vkv': a {model.config.model_type} model keeps no key/value states that vkv "
            f"stores (its layers are {', '.join(VKVCache.layer_kinds(model.config))}; vkv stores full, sliding and "
            f"chunked attention); generating with transformers' default cache instead"
            + (", without the prefix store given in cache_config" if store_given else ""), UserWarning, stacklevel=4)
        return transformers_own()
    expand = max(generation_config.num_beams or 1, generation_config.num_return_sequences or 1)
    cache_config = from_transformers_keys(config_dict(generation_config.cache_config))  # max_cache_len: max_tokens
    asked = cache_config.get("max_tokens")
    drafted = _drafted_past(generation_config)
    if isinstance(asked, int) and not isinstance(asked, bool) and 0 < asked < max_cache_length + drafted:
        # refused before anything is built or computed, not at the step that would pass it
        key = "max_cache_len" if "max_cache_len" in generation_config.cache_config else "max_tokens"
        raise CapacityError(
            f"cache_config[{key!r}]={asked} holds fewer tokens than this call may cache: "
            f"{max_cache_length + drafted} ({_may_cache(drafted)}): raise it to at least {max_cache_length + drafted}, "
            f"or leave it unset (vkv reserves address space for the model's context)")
    store, cache_config = reuse.split_prefix_store(cache_config)
    if generation_config.is_assistant:
        # an assistant's cache is its own (5.17 copies "vkv" and the main call's cache_config to the
        # assistant's config): not the store, nor the paged layout's options unless it reads that layout
        store = None
        if getattr(model.config, "_attn_implementation", None) != PAGED_ATTENTION:
            cache_config = {k: v for k, v in cache_config.items() if k not in PAGED_KEYS}
    refusal = None if store is None else reuse.model_refusal(model, store)  # asked once a call
    memory = None if store is None or refusal is not None else reuse.memory_for(model, store, cache_config)
    new = generation_config.max_new_tokens  # generate sizes the cache max_length - 1 = prompt + new - 1
    build = functools.partial(
        VKVCache.for_generate, model, batch_size=batch_size, expand=expand, max_length=max_cache_length + 1 + drafted,
        cache_config=cache_config, num_beams=generation_config.num_beams or 1,
        compiling=_compiles(model, generation_config),
        prompt_tokens=None if new is None else max(max_cache_length + 1 - new, 0),
        max_cache_len=getattr(generation_config, "max_cache_len", None))
    try:
        cache: Any = build(memory_of=memory)
    except MappingLimitError as exc:
        if memory is None or not exc.store_layout:
            raise
        # Rows are limited by memory, never by mappings: rows that cannot share the store's
        # head-major entries within the mapping limit run without the store (the layout rule
        # gives them token-major), and the report says why and what would let them reuse.
        refusal = (f"{batch_size * expand} rows of the store's head-major layout would pass the kernel's mapping "
                   f"limit (vm.max_map_count): this call ran without the store; for reuse at this size use a "
                   f"token-major store, PrefixStore(model.config, cache_config={{'layout': 'token_major'}})")
        cache = build(memory_of=None)
    if store is not None:
        reuse.attach(cache, store, model, owned=True, rows=batch_size * expand, num_beams=generation_config.num_beams,
                     eos_token_id=generation_config.eos_token_id, refusal=refusal)
    else:
        begin(cache, owned=True, rows=batch_size * expand, num_beams=generation_config.num_beams)
    cache.call.tokens = max_cache_length + drafted
    if model.config.is_encoder_decoder:
        cache = VKVEncoderDecoderCache(cache, DynamicCache(config=model.config.get_text_config(decoder=True)))
    model_kwargs[cache_kwarg()] = cache
    if generation_config.is_assistant:
        cache.activate_past_recording()
    return None


def _drafted_past(generation_config: Any) -> int:
    """Tokens a call may cache past ``max_length - 1``: prompt lookup's candidates are cut at the
    prompt's length, not at ``max_length``, so a verifying forward writes up to
    ``prompt_lookup_num_tokens`` past it before generate crops them (an assistant's drafts are cut
    at ``max_length``)."""
    return 0 if generation_config.is_assistant else int(generation_config.prompt_lookup_num_tokens or 0)


def _may_cache(drafted: int) -> str:
    return ("its prompt and max_new_tokens, less the last token, which is not cached"
            + (f", and the {drafted} tokens prompt lookup may draft past them" if drafted else ""))


def _check_compiled(model: Any) -> None:
    """A model whose modules were compiled in place (``model.compile()``: torch keeps the compiled
    call in ``_compiled_call_impl``) raises :class:`CompiledModuleError` before anything is computed:
    its compiled attention read vkv's views with other kernels than DynamicCache's tensors, logits
    1.2e-7 apart (greedy, a tiny Llama). ``compile_config`` compiles the forward transformers' way,
    which vkv's static layout serves exactly. The same for modules compiled by hand: a forward
    replaced by its ``torch.compile`` (``model.forward = torch.compile(model.forward)``: decode
    logits 2.1e-6 apart) and a module replaced by its compiled wrapper (``layers[i] =
    torch.compile(layers[i])``: a raw inductor error midway)."""
    compiled = [name or type(model).__name__ for name, module in model.named_modules() if _compiled(module)]
    if compiled:
        raise CompiledModuleError(
            f"cache_implementation='vkv' on a model whose modules were compiled ({', '.join(compiled[:3])}"
            f"{', ...' if len(compiled) > 3 else ''}: model.compile(), or torch.compile of a module or its forward): "
            f"compiled code reads vkv's key/value views with "
            f"other kernels than DynamicCache's tensors, a rounding apart. Generate with the model uncompiled, or compile "
            f"its decoding the transformers way: generate(..., cache_implementation='vkv', "
            f"compile_config=CompileConfig()) (vkv's static layout, StaticCache's logits bit for bit)")


def _compiled(module: Any) -> bool:
    """Whether ``module`` runs compiled code: compiled in place (``module.compile()``), a
    ``torch.compile`` wrapper of a module, or a forward replaced by its ``torch.compile``."""
    return (getattr(module, "_compiled_call_impl", None) is not None
            or (type(module).__name__ == "OptimizedModule" and type(module).__module__.startswith("torch._dynamo"))
            or hasattr(vars(module).get("forward"), "_torchdynamo_orig_callable"))


def _check_layers(model: Any, cache: Any) -> None:
    """A vkv cache passed to ``generate`` that was made for a model of another depth raises
    :class:`ArgumentError` before anything is computed: a deeper model's forward would fill the
    cache's layers and then fail at the first layer it lacks, a shallower one would leave its last
    layers behind (DynamicCache accepts both)."""
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config"):
        return
    made_for = getattr(cache.config, "num_hidden_layers", None)
    has = getattr(config.get_text_config(decoder=True), "num_hidden_layers", None)
    if isinstance(made_for, int) and isinstance(has, int) and made_for != has:
        raise ArgumentError(
            f"the cache passed to generate was made for a model of {made_for} layers (its config's "
            f"num_hidden_layers) and this model has {has}: a cache serves the model whose config made it; nothing "
            f"was computed and the cache is as it was (make this model's with hf_vkv.VKVCache(model.config), or "
            f"let generate make it with cache_implementation='vkv')")


def _check_room(cache: Any, generation_config: Any, max_cache_length: int) -> None:
    """A vkv cache passed to ``generate`` (a conversation continued, a cache made by hand) whose
    rows have no room for what the call may cache raises :class:`CapacityError` before anything is
    computed, not at the step that would pass it (the cache is left as it was)."""
    if generation_config.is_assistant:
        return
    room, drafted = cache.reserved_tokens(), _drafted_past(generation_config)
    if room is not None and room < max_cache_length + drafted:
        raise CapacityError(
            f"the cache passed to generate has room for {room} tokens a row and this call may cache "
            f"{max_cache_length + drafted} ({_may_cache(drafted)}); nothing was computed and the cache is as it was: "
            f"generate fewer tokens, or start the conversation with a cache that has room for it "
            f"(cache_config={{'max_tokens': N}} on its first call, or VKVCache(config, max_tokens=N))")


def _check_continued(cache: VKVCache, input_ids: Any) -> None:
    """A decoder's vkv cache passed to ``generate`` that holds as many tokens a row as the call's
    ``input_ids``, or more (the new tokens passed alone, without the history), raises
    :class:`ArgumentError` before anything is computed: the forward got no token to compute and
    failed inside the model (DynamicCache's ``RuntimeError: cannot reshape tensor of 0 elements``)."""
    held = cache.get_seq_length()
    if held and isinstance(input_ids, torch.Tensor) and input_ids.shape[-1] <= held:
        raise ArgumentError(
            f"the cache passed to generate already holds {held} tokens a row and input_ids hold "
            f"{input_ids.shape[-1]}: a call that continues a cache passes the whole sequence, the tokens the "
            f"cache holds followed by the new ones (out.sequences with the new tokens appended); nothing was "
            f"computed and the cache is as it was")


def _prefill(original: Any, model: Any, input_ids: Any, generation_config: Any, model_kwargs: dict,
             *args: Any, **kwargs: Any) -> Any:
    """``GenerationMixin._prefill``: rows start from stored prefixes (a call with a store), then
    the prompt's forward runs once per prompt where the rows repeat prompts (prefill once, which
    runs ``original``)."""
    found = prefill_once.vkv_cache_of(model_kwargs)
    cache = None if found is None else found[1]
    if found is not None and found[0] is cache and model_kwargs.get("inputs_embeds") is None:
        _check_continued(cache, input_ids)
    call = None if cache is None else cache.call
    if call is not None:
        with section():  # Ctrl-C waits for the rows to be taken from the store and recorded (interrupts.py)
            reuse.start(call, cache, model, input_ids, model_kwargs)
    outputs = prefill_once.prefill(original, model, input_ids, generation_config, model_kwargs, *args, **kwargs)
    if call is not None:
        with section():
            reuse.count_prefill(call, cache)
    return outputs


def _decoding_loop(original: Any, model: Any, input_ids: Any, *args: Any, **model_kwargs: Any) -> Any:
    """A decoding loop of ``generate`` (``_sample``, ``_beam_search``, ``_assisted_decoding``):
    when it returns, a call with a prefix store inserts its finished rows; however it ends, the
    call's record leaves the cache, and a cache the call built is closed if the loop raised."""
    found = prefill_once.vkv_cache_of(model_kwargs)
    cache = None if found is None else found[1]
    call = None if cache is None else cache.call
    mask = model_kwargs.get("attention_mask")
    if cache is not None and isinstance(mask, torch.Tensor) and not model.config.is_encoder_decoder \
            and not bool(mask.all()):
        cache.padded = True  # rows hold columns the mask hides (every mode, assisted too): no prefix to keep by hand
    if call is None:
        out = original(model, input_ids, *args, **model_kwargs)
        if cache is not None:
            cache.check_reads()
        return out
    # The loop's compute stops at Ctrl-C; what the call does with the store and its pages after it
    # (finish, give back, end) is done whole before an interrupt is raised (memory/interrupts.py; generate's
    # wrapper keeps the handler in place for the call).
    finished = False  # a Ctrl-C held through finish is raised as it ends: the rows are the store's by then
    try:
        out = original(model, input_ids, *args, **model_kwargs)
        with section():
            cache.check_reads()  # the last layers' attention got what their update returned
            returned = not hasattr(out, "shape")  # a dict output carries the cache back to the caller
            reuse.finish(call, cache, getattr(out, "sequences", None) if returned else out, returned=returned)
            finished = True
    except BaseException as exc:
        if finished:
            raise
        with section():
            whole = _whole_call(exc, cache, call)
            if call.owned and not reuse.give_back(call, cache):  # a store entry it took over goes back
                cache.close()  # nobody can reach it after the error: its pages go back now
        if whole is not None:
            raise whole from None
        raise
    finally:
        with section():
            end(cache)
    return out


def _whole_call(exc: BaseException, cache: Any, call: Any) -> KVCacheOutOfMemory | None:
    """An out-of-memory error of a call that ``generate`` sized, restated with a budget that
    holds the whole call (``None``: another error, or a cache passed in, whose size is its own)."""
    if not isinstance(exc, KVCacheOutOfMemory) or call.tokens is None:
        return None
    need = cache.bytes_at_most(rows=call.rows, tokens=call.tokens)
    if not need:  # the paged layout, or a group refused before it made its buffer (static): the error names its need
        return None
    return exc.for_whole_call(rows=call.rows, tokens=call.tokens, call_bytes=need,
                              held_bytes=cache.stats().resident_bytes)


def _serve_request(original: Any, runner: Any, request_id: Any, inputs: Any, generation_kwargs: dict[str, Any],
                   *args: Any, **kwargs: Any) -> Any:
    """The server's ``generate`` of a request, in the model's process: the request's keywords with
    vkv and the model's store; a bad request is refused before it is queued."""
    try:
        serving.prepare_request(runner.model, inputs, generation_kwargs)
    except VKVError as exc:
        raise serving.served_error(exc) from exc
    return original(runner, request_id, inputs, generation_kwargs, *args, **kwargs)


def _served_generate(original: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
    """``generate`` in a model's process of the server: an hf_vkv error leaves as a ``ValueError`` naming it."""
    try:
        return original(model, *args, **kwargs)
    except serving.ServedRequestError:
        raise
    except VKVError as exc:
        raise serving.served_error(exc) from exc


def _serve_app(original: Any, model_manager: Any, *args: Any, **kwargs: Any) -> Any:
    """The server's app, with ``GET /v1/vkv/stores`` and errors OpenAI clients show (:func:`serving.extend_app`)."""
    app = original(model_manager, *args, **kwargs)
    serving.extend_app(app, model_manager)
    return app
