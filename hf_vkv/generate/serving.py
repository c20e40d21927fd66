"""Serving: transformers' own server (``transformers serve``) generating with vkv, one prefix store per model.

``hf-vkv serve`` (:func:`hf_vkv.cli`) runs transformers' server as it is - its options, endpoints,
handlers, chat templates and streaming - after :func:`hf_vkv.generate.registry.register_serving`
wrapped the two methods through which its default path calls ``model.generate()``
(``GenerateManager.generate_streaming`` and ``generate_non_streaming``). Before each request's
generate, :func:`prepare_request`:

* gives the model its prefix store at the server's start when the server preloads it
  (:func:`prepare_preloaded`), else on its first request (:func:`store_of`): a
  :class:`~hf_vkv.PrefixStore` put in ``model.generation_config.cache_config`` with
  ``cache_implementation="vkv"``. The server deep-copies that config for every request
  (``BaseHandler._build_generation_config``) and a store deep-copies as itself, so every request,
  client and turn of that model shares one store: a conversation prefills only the tokens no
  earlier request computed (:mod:`hf_vkv.generate.reuse`), within the store's budget (LRU). A
  server started with ``--prefix-dir`` (:data:`PREFIX_DIR_ENV`) starts each store from that saved
  folder, its pages mapped: a long system prompt saved once (``hf-vkv prefix save``) is not
  prefilled even by a fresh server's first request, and server processes on one machine share its
  pages (:func:`start_from_folder`). The objects alive then (the model, the server's) leave the
  garbage collector's full collections (:func:`freeze_long_lived`);
* makes the request's own config generate with vkv and that store when the request names no
  other cache (a request's ``generation_config`` JSON replaces the model's config in the server:
  its ``cache_config`` keys are vkv's options, checked here, and the store is added to them; a
  request naming ``cache_implementation="dynamic"`` or another cache gets that cache);
* refuses, with a typed hf_vkv error, a malformed ``cache_config`` and a prompt that does not fit
  the model's context (``max_position_embeddings``), before anything runs. A request whose
  ``page_bytes`` or ``budget_bytes`` differ from the store's gets a cache of its own (no reuse:
  the store's pages have the store's size and budget).

Every hf_vkv error a request raises - those, and one raised while generating (out of KV memory) -
is answered as an HTTP 400 in OpenAI's error shape (:func:`error_response`, which
``register_serving`` adds to the server's app), so a client sees the message naming the problem;
a streamed request that fails after its stream started gets the server's own error event.

Requests of one model run one ``generate`` at a time on the server's inference thread for that
model, so the store sees one call at a time (and it locks its own state besides). The server's
continuous-batching path (``--continuous-batching``) is transformers' own paged cache: vkv does not
touch it (its manager is another class).
"""

from __future__ import annotations

import gc
import os
import warnings
from typing import Any

from ..cache import VKVCache
from ..cache.options import PREFIX_STORE_KEY, CacheOptions, config_dict
from ..memory.errors import CacheOptionError, VKVError
from ..prefix import PrefixFileError, PrefixMismatchError, PrefixStore
from .names import CACHE_IMPLEMENTATION
from .reuse import memory_conflict

__all__ = ["DEFAULT_STORE_BYTES", "PREFIX_DIR_ENV", "STORE_BYTES_ENV", "ContextTooLongError", "error_response",
           "freeze_long_lived", "prepare_preloaded", "prepare_request", "start_from_folder", "store_bytes",
           "store_of"]

#: Environment variable holding each model's store budget in bytes (``hf-vkv serve --prefix-store-mib``).
STORE_BYTES_ENV = "HF_VKV_SERVE_STORE_BYTES"
#: Environment variable naming a folder :meth:`PrefixStore.save` wrote (``hf-vkv serve --prefix-dir``):
#: each model's store starts from it, its pages mapped, where it was saved for that model.
PREFIX_DIR_ENV = "HF_VKV_SERVE_PREFIX_DIR"
#: A model's store budget when :data:`STORE_BYTES_ENV` is unset: 1 GiB of KV pages (SmolLM2-135M in
#: float32 holds 46 KiB a token: ~23k tokens of conversations).
DEFAULT_STORE_BYTES = 1 << 30


class ContextTooLongError(VKVError, ValueError):
    """A request's prompt does not fit the model's context (``max_position_embeddings``)."""


def store_bytes() -> int:
    """The budget of each model's store: :data:`STORE_BYTES_ENV`, else :data:`DEFAULT_STORE_BYTES`."""
    raw = os.environ.get(STORE_BYTES_ENV)
    if raw is None:
        return DEFAULT_STORE_BYTES
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value <= 0:
        raise CacheOptionError(f"{STORE_BYTES_ENV}={raw!r} must be a positive number of bytes (the budget of "
                               f"each model's prefix store), or unset for the default")
    return value


def store_of(model: Any) -> PrefixStore | None:
    """The model's prefix store, made on its first request (``None``: vkv cannot store this
    model's K/V, or its config names another cache)."""
    config = model.generation_config
    options = config.cache_config if isinstance(config.cache_config, dict) else None
    store = None if options is None else options.get(PREFIX_STORE_KEY)
    if isinstance(store, PrefixStore):
        return store
    if config.cache_implementation not in (None, CACHE_IMPLEMENTATION) or not VKVCache.stores_kv(model.config):
        return None
    store = PrefixStore(model.config, budget_bytes=store_bytes())
    start_from_folder(store, model)
    config.cache_implementation = CACHE_IMPLEMENTATION
    config.cache_config = {**config_dict(options), PREFIX_STORE_KEY: store}
    freeze_long_lived()
    return store


def start_from_folder(store: PrefixStore, model: Any) -> int:
    """Load the folder :data:`PREFIX_DIR_ENV` names (if set) into the model's new ``store``, its
    pages mapped (:meth:`PrefixStore.load`, with every check of the model, weights and dtype), and
    return the tokens loaded. A folder saved for another model, other weights or another dtype, or
    a damaged one, leaves the store empty (a refused load inserts nothing) with one warning naming
    the folder and why: the model is served without it, its answers the same, its first turns
    prefilled. A folder over the store's budget loses what does not fit as it loads (least
    recently used first, as any insert), with one warning saying so."""
    folder = os.environ.get(PREFIX_DIR_ENV)
    if not folder:
        return 0
    name = getattr(model.config, "name_or_path", None) or model.config.model_type
    try:
        tokens = store.load(folder, model=model)
    except (PrefixMismatchError, PrefixFileError) as exc:
        warnings.warn(f"hf-vkv serve: the prefix folder {folder} was not loaded for {name} "
                      f"({type(exc).__name__}: {' '.join(str(exc).split())}); this model is served without it",
                      UserWarning, stacklevel=2)
        return 0
    evicted = store.stats().evictions
    if evicted:  # the folder holds more than the store's budget: what did not fit went at once
        budget = store.budget_bytes or 0
        warnings.warn(f"hf-vkv serve: the prefix folder {folder} holds more than {name}'s store budget of "
                      f"{budget / 2**20:,.0f} MiB: {evicted} of its entries were evicted as it loaded (raise "
                      f"--prefix-store-mib)", UserWarning, stacklevel=2)
    return tokens


def prepare_preloaded(model_manager: Any, generation_state: Any) -> None:
    """At the server's start: each model it preloaded (``transformers serve MODEL``) gets its store
    now (:func:`store_of`: a ``--prefix-dir`` folder mapped, the long-lived objects frozen), not on
    its first request, which then pays neither. A model that the continuous-batching path will
    serve (transformers' own) is left as it is; a model loaded later gets its store on its first
    request."""
    from transformers.cli.serving.model_manager import ModelManager

    for timed in list(getattr(model_manager, "loaded_models", {}).values()):
        model = getattr(timed, "model", None)
        if model is None:
            continue
        modality = ModelManager.get_model_modality(model, getattr(timed, "processor", None))
        if generation_state is None or not generation_state.use_continuous_batching(model, modality):
            store_of(model)


def freeze_long_lived() -> None:
    """Move every object alive now out of the cyclic garbage collector's sight, after one
    collection (:func:`gc.freeze`): on a model's first request that is the model, its modules and
    the server's own objects, which live as long as the server. A full collection walks every
    tracked object: with the embedded SmolLM2 loaded in the server that walk took ~0.28 s (550k
    objects), inside whichever request it fell in (one turn in ~10 of a chat); after the freeze,
    under 1 ms. Frozen objects are still freed when their last reference goes; only cycles among
    them are never collected."""
    gc.collect()
    gc.freeze()


def prepare_request(model: Any, inputs: Any, generation_config: Any) -> None:
    """Make one request's ``generation_config`` (the server's copy for it) generate with vkv and
    the model's store, or raise a typed error (the request is refused, nothing has run)."""
    ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if ids is not None and isinstance(limit, int) and ids.shape[-1] >= limit:
        raise ContextTooLongError(
            f"the prompt has {ids.shape[-1]:,} tokens, but {model.config.model_type} takes at most {limit:,} "
            f"(max_position_embeddings) with room for one generated token: shorten the conversation")
    options = {k: v for k, v in config_dict(generation_config.cache_config).items() if k != PREFIX_STORE_KEY}
    store = None if generation_config.cache_implementation not in (None, CACHE_IMPLEMENTATION) else store_of(model)
    if store is None:
        # another cache (or a model vkv does not store): its own options, and not the model's store,
        # which generate would otherwise take from the model's config for an unset cache_config
        generation_config.cache_config = options
        return
    CacheOptions.from_dict(options)  # a malformed key or value: CacheOptionError naming it
    generation_config.cache_implementation = CACHE_IMPLEMENTATION
    own_memory = memory_conflict(store.memory(model.device), options) is not None
    generation_config.cache_config = options if own_memory else {**options, PREFIX_STORE_KEY: store}


def error_response(request: Any, exc: VKVError) -> Any:
    """The server's answer to an hf_vkv error: HTTP 400, the message in OpenAI's error shape
    (``{"error": {"message", "type", "code"}}``, what OpenAI clients show)."""
    from fastapi.responses import JSONResponse

    message = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": None,
                                   "code": type(exc).__name__}}, status_code=400)
