"""Serving: transformers' own server (``transformers serve``) generating with vkv, one prefix store per model.

``hf-vkv serve`` (:func:`hf_vkv.cli`) runs transformers' server as it is - its options, endpoints,
handlers, chat templates and streaming - after :func:`hf_vkv.generate.registry.register_serving`
patched it. Since transformers 5.25 the server runs each model in a process of its own (the
*engine*, which transformers spawns: ``EngineClient.start_process``), and the API server sends it
each request's tokenized inputs and generation keywords. So:

* the engine's entry (``EngineClient.run_engine``) is :func:`hf_vkv.generate.registry.run_engine`:
  the spawned process imports hf_vkv to run it, installs the engine's patches, and once its model
  has loaded gives it its prefix store (:func:`store_of`) unless the continuous-batching path
  serves it;
* :func:`store_of` puts a :class:`~hf_vkv.PrefixStore` in ``model.generation_config.cache_config``
  with ``cache_implementation="vkv"``, which every request's ``generate`` starts from (``generate``
  deep-copies that config, and a store deep-copies as itself), so every request, client and turn of
  that model shares one store: a conversation prefills only the tokens no earlier request computed
  (:mod:`hf_vkv.generate.reuse`), within the store's budget (LRU). A server started with
  ``--prefix-dir`` (:data:`PREFIX_DIR_ENV`) starts each store from that saved folder, its pages
  mapped: a long system prompt saved once (``hf-vkv prefix save``) is not prefilled even by a fresh
  server's first request, and processes on one machine share its pages (:func:`start_from_folder`).
  The objects alive then (the model) leave the garbage collector's full collections
  (:func:`freeze_long_lived`);
* before each request's ``generate`` (``GenerateRunner.generate``, in the engine),
  :func:`prepare_request` makes the request's keywords generate with vkv and that store when the
  request names no other cache (a request's ``generation_config`` JSON becomes keywords of
  ``generate``: its ``cache_config`` keys are vkv's options, checked here, and the store is added to
  them; a request naming ``cache_implementation="dynamic"`` or another cache gets that cache), and
  refuses a malformed ``cache_config`` and a prompt that does not fit the model's context
  (``max_position_embeddings``), before anything runs. A request whose ``page_bytes`` or
  ``budget_bytes`` differ from the store's gets a cache of its own (no reuse).

Every hf_vkv error a request raises - those, and one raised while generating (out of KV memory) -
crosses to the API server as a :class:`ServedRequestError`, a ``ValueError`` whose message starts
with the error's name, which the server answers with an HTTP 400 naming the problem, in the
server's shape and OpenAI's (:func:`error_response`); a streamed request that fails after its
stream started gets the server's own error event.

``GET /v1/vkv/stores`` (:func:`extend_app`) answers each running model's store: its
:class:`~hf_vkv.PrefixStats` (lookups, hits, tokens reused, bytes held and budget), read in the
model's process between requests after :meth:`PrefixStore.check_invariants`.

Requests of one model run one ``generate`` at a time on the engine's runner thread, so the store
sees one call at a time (and it locks its own state besides). The server's continuous-batching path
(``--continuous-batching``) is transformers' own paged cache: vkv does not touch it.
"""

from __future__ import annotations

import dataclasses
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

__all__ = ["DEFAULT_STORE_BYTES", "PREFIX_DIR_ENV", "STORES_ROUTE", "STORE_BYTES_ENV", "ContextTooLongError",
           "ServedRequestError", "error_response", "extend_app", "freeze_long_lived", "prepare_request", "served_error",
           "start_from_folder", "store_bytes", "store_of", "store_report"]

#: Environment variable holding each model's store budget in bytes (``hf-vkv serve --prefix-store-mib``).
STORE_BYTES_ENV = "HF_VKV_SERVE_STORE_BYTES"
#: Environment variable naming a folder :meth:`PrefixStore.save` wrote (``hf-vkv serve --prefix-dir``):
#: each model's store starts from it, its pages mapped, where it was saved for that model.
PREFIX_DIR_ENV = "HF_VKV_SERVE_PREFIX_DIR"
#: A model's store budget when :data:`STORE_BYTES_ENV` is unset: 1 GiB of KV pages (SmolLM2-135M in
#: float32 holds 46 KiB a token: ~23k tokens of conversations).
DEFAULT_STORE_BYTES = 1 << 30


#: The API server's route answering each running model's store (:func:`extend_app`).
STORES_ROUTE = "/v1/vkv/stores"


class ContextTooLongError(VKVError, ValueError):
    """A request's prompt does not fit the model's context (``max_position_embeddings``)."""


class ServedRequestError(VKVError, ValueError):
    """An hf_vkv error a request raised in the model's process, as the API server gets it: a
    ``ValueError`` (its HTTP 400) whose message starts with the error's name."""


def served_error(exc: VKVError) -> ServedRequestError:
    """``exc`` as a :class:`ServedRequestError`: ``"<its class>: <its message on one line>"``."""
    return ServedRequestError(f"{type(exc).__name__}: {' '.join(str(exc).split())}")


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


def prepare_request(model: Any, inputs: Any, generation_kwargs: dict[str, Any]) -> None:
    """Make one request's ``generation_kwargs`` (``generate``'s keywords besides its inputs, over
    the model's config) generate with vkv and the model's store, or raise a typed error (the
    request is refused, nothing has run)."""
    ids = inputs.get("input_ids") if hasattr(inputs, "get") else None
    limit = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None)
    if ids is not None and isinstance(limit, int) and ids.shape[-1] >= limit:
        raise ContextTooLongError(
            f"the prompt has {ids.shape[-1]:,} tokens, but {model.config.model_type} takes at most {limit:,} "
            f"(max_position_embeddings) with room for one generated token: shorten the conversation")
    named = generation_kwargs.get("cache_implementation")
    store = None if named not in (None, CACHE_IMPLEMENTATION) else store_of(model)
    asked = generation_kwargs.get("cache_config")
    given = config_dict(asked).get(PREFIX_STORE_KEY)
    if given is not None and given is not store:  # the server's own store comes back in a copied config
        raise CacheOptionError(f"a request's cache_config cannot name a {PREFIX_STORE_KEY} (got {given!r:.40}): the "
                               f"server keeps one store per model, which every request with vkv uses; leave the key out")
    options = {k: v for k, v in config_dict(asked).items() if k != PREFIX_STORE_KEY}
    if store is None:
        # another cache (or a model vkv does not store): its own options, not the model's store,
        # which generate would otherwise take from the model's config
        generation_kwargs["cache_config"] = options
        return
    CacheOptions.from_dict(options)  # a malformed key or value: CacheOptionError naming it
    if asked is None and named is None:
        return  # the model's config: vkv with its store
    generation_kwargs["cache_implementation"] = CACHE_IMPLEMENTATION
    own_memory = memory_conflict(store.memory(model.device), options) is not None
    generation_kwargs["cache_config"] = options if own_memory else {**options, PREFIX_STORE_KEY: store}


def store_report(model: Any, processor: Any = None) -> dict[str, Any] | None:
    """The model's store, checked (:meth:`PrefixStore.check_invariants`) and counted
    (:class:`~hf_vkv.PrefixStats` as a dict); ``None`` where the model has none. Run in the model's
    process (``EngineClient.submit``), between its requests."""
    config = model.generation_config
    store = config.cache_config.get(PREFIX_STORE_KEY) if isinstance(config.cache_config, dict) else None
    if not isinstance(store, PrefixStore):
        return None
    store.check_invariants()
    return dataclasses.asdict(store.stats())


def extend_app(app: Any, model_manager: Any) -> None:
    """Two additions to the server's app: ``GET`` :data:`STORES_ROUTE`, ``{"object": "list", "data":
    [{"model": id, "store": stats or null}, ...]}`` for each model whose process runs on the default
    path; and a request's ``ValueError`` (the server's HTTP 400: a refused request, vkv's
    :class:`ServedRequestError` among them) answered in OpenAI's error shape as well as the server's
    own (:func:`error_response`), so that OpenAI clients show its message."""
    from fastapi.responses import JSONResponse

    async def stores() -> Any:
        data = []
        for model_id, engine in list(model_manager.engines.items()):
            if engine.process_running and not engine.use_cb:
                data.append({"model": model_id, "store": await engine.submit(store_report)})
        return JSONResponse({"object": "list", "data": data})

    app.add_api_route(STORES_ROUTE, stores, methods=["GET"])
    app.add_exception_handler(ValueError, error_response)


def error_response(request: Any, exc: ValueError) -> Any:
    """HTTP 400 for a request's ``ValueError``: the server's own body (``{"detail": message}``) and
    OpenAI's error shape (``{"error": {"message", "type", "param", "code"}}``, which OpenAI clients show)."""
    from fastapi.responses import JSONResponse

    message = " ".join(str(exc).split())
    name = message.split(": ", 1)[0]  # vkv's errors start with their class's name
    code = name if ": " in message and name.isidentifier() else None
    return JSONResponse({"detail": message, "error": {"message": message, "type": "invalid_request_error",
                                                      "param": None, "code": code}}, status_code=400)
