"""Options of a :class:`~hf_vkv.cache.VKVCache`, as given in ``cache_config={...}`` or as keywords."""

from __future__ import annotations

import difflib

from dataclasses import dataclass, fields
from collections.abc import Mapping
from typing import Any, Literal

from ..memory.errors import CacheOptionError, CacheOptionTypeError
from ..memory.limits import MIN_PAGE_BYTES, check_page_bytes
from .layouts import LAYOUTS

__all__ = ["CacheOptions", "LAYOUT_NAMES", "PAGED_KEYS", "PREFIX_STORE_KEY", "TRANSFORMERS_KEYS", "config_dict", "from_transformers_keys"]

#: The ``cache_config`` key of ``generate(cache_implementation="vkv")`` that turns on prefix reuse:
#: a :class:`~hf_vkv.PrefixStore` (see :mod:`hf_vkv.generate.reuse`).
PREFIX_STORE_KEY = "prefix_store"

Groups = Literal["kind", "layer"]
PagedKernel = Literal["exact", "fused"]
#: Names ``layout`` accepts: the layouts, ``"static"`` (the compileable layout over the device's
#: contiguous one) and ``"contiguous"`` (the device's default contiguous layout).
LAYOUT_NAMES = (*LAYOUTS, "static", "contiguous")
#: Options of the paged layout only (:meth:`CacheOptions.check_layout`).
PAGED_KEYS = ("block_tokens", "paged_kernel")
#: Options that were removed, and what to write instead.
REMOVED_KEYS = {
    "group_policy": "it was replaced by 'layout' and 'groups': write {'layout': 'token_major'} for 'model', "
                    "{'layout': 'head_major'} for 'head', {'layout': 'token_major', 'groups': 'layer'} for 'layer'",
}


def config_dict(config: Any) -> dict[str, Any]:
    """``cache_config`` as a new dict (``None``: empty); :class:`~hf_vkv.CacheOptionTypeError`
    naming it for anything that is not a mapping (a string such as ``"page_bytes=4096"``) and for
    a key that is not an option's name (a string)."""
    if config is not None and not isinstance(config, Mapping):
        raise CacheOptionTypeError(f"cache_config must be a dict such as {{'page_bytes': 4096}}, got "
                                   f"{type(config).__name__} {config!r}")
    odd = [key for key in (config or {}) if not isinstance(key, str)]
    if odd:
        raise CacheOptionTypeError(f"cache_config's keys are option names (strings such as 'page_bytes'), got "
                                   f"{type(odd[0]).__name__} {odd[0]!r}")
    return dict(config or {})


@dataclass(frozen=True, slots=True, kw_only=True)
class CacheOptions:
    """What a user can set through ``generate(..., cache_config={...})`` or ``VKVCache(...)``.

    * ``layout``: one of :data:`LAYOUT_NAMES` (see :mod:`hf_vkv.cache.layouts`). Default: ``"paged"``
      when the model's attention is ``"vkv_paged"``, else the device's default contiguous layout
      (:func:`hf_vkv.devices.policy_for`: head-major on the CPU, token-major on CUDA).
    * ``groups``: ``"kind"`` puts all layers of one kind (full / sliding window) in one group;
      ``"layer"`` gives every layer its own group (vAttention's layout).
    * ``page_bytes``: physical page size (default: the layout's preferred size on the device; on
      the host a multiple of 4 KiB). Sharing and copy-on-write work at this granularity.
    * ``budget_bytes``: most physical KV bytes the cache may hold per device (default: unbounded on
      the host, the free device memory less a margin on CUDA). Going over raises
      ``KVCacheOutOfMemory``.
    * ``share_prompts``: store the prompt once for the rows that ``generate`` expanded from it
      (beams, ``num_return_sequences``), after checking the rows really are equal.
    * ``prefill_once``: with ``share_prompts``, ``generate``'s prefill runs each expanded prompt
      through the model once (one row per prompt, not ``max(num_beams, num_return_sequences)``)
      and the other rows take its pages (:mod:`hf_vkv.generate.prefill_once`; each forward's calls are
      proven exact for their shapes and threads, else the prefill runs on every row). Default
      (``None``): on on the CPU, off on CUDA until a GPU measurement says so.
    * ``cascade_half_precision``: let the ``"vkv_cascade"`` attention read shared prefixes once in
      bfloat16 / float16 too (default ``False``: there it can change tokens against DynamicCache,
      ``docs/shared_prompts.md`` has the measurement, so half-precision caches take sdpa's path and
      :meth:`~hf_vkv.VKVCache.stats` says so in ``cascade``). Float32 is not affected.
    * ``block_tokens``: tokens per block in the paged layout (default
      :data:`~hf_vkv.devices.PAGED_BLOCK_TOKENS`).
    * ``paged_kernel``: how ``"vkv_paged"`` reads the paged layout on CUDA. ``"exact"`` (default)
      gathers each layer's tokens through the block tables and runs transformers' sdpa on them:
      DynamicCache's logits bit for bit. ``"fused"`` runs a paged kernel that reads the blocks in
      place (Triton, or flash-attn's paged path): no gather, but its sums are ordered otherwise than
      sdpa's, so logits differ in the last bits and a near-tie can change a token (measured on an H100,
      ``docs/paged.md``). On the CPU both gather and run sdpa.
    * ``max_tokens``: tokens each row can hold (default: the model's ``max_position_embeddings``,
      or the generate call's ``max_length`` when larger). Only address space is reserved for it
      (except in the static layout, whose attention reads the whole capacity).
    * ``map_ahead``: static layout only: tokens mapped ahead of the next write, outside the
      compiled step (default 32).

    ``cache_config`` of ``generate`` also takes ``"prefix_store"`` (:data:`PREFIX_STORE_KEY`): a
    :class:`~hf_vkv.PrefixStore` whose prefixes every call reuses (:mod:`hf_vkv.generate.reuse`); it
    is generate's, not a cache option (a cache built by hand starts from ``store.lookup``).
    """

    layout: str | None = None
    groups: Groups = "kind"
    page_bytes: int | None = None
    budget_bytes: int | None = None
    share_prompts: bool = True
    prefill_once: bool | None = None
    cascade_half_precision: bool = False
    block_tokens: int | None = None
    paged_kernel: PagedKernel = "exact"
    max_tokens: int | None = None
    map_ahead: int | None = None

    def __post_init__(self) -> None:
        for name in ("page_bytes", "budget_bytes", "block_tokens", "max_tokens", "map_ahead"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise CacheOptionTypeError(f"cache_config[{name!r}] must be an int, got {type(value).__name__} {value!r}")
            if value is not None and name != "map_ahead" and value <= 0:
                raise CacheOptionError(f"cache_config[{name!r}] must be a positive int, got {value!r}")
        if self.page_bytes is not None:
            check_page_bytes(self.page_bytes)  # the backend of the device checks its own range too
        if self.budget_bytes is not None and self.budget_bytes < (self.page_bytes or MIN_PAGE_BYTES):
            raise CacheOptionError(f"cache_config['budget_bytes']={self.budget_bytes:,} is smaller than one page "
                                   f"({self.page_bytes or MIN_PAGE_BYTES:,} bytes): give at least a page per layer "
                                   f"group, or leave it unset for the default")
        if self.map_ahead is not None and self.map_ahead < 0:
            raise CacheOptionError(f"cache_config['map_ahead'] must be an int >= 0, got {self.map_ahead!r}")
        if self.layout is not None and self.layout not in LAYOUT_NAMES:
            raise CacheOptionError(f"cache_config['layout'] must be one of {list(LAYOUT_NAMES)}, got {self.layout!r}")
        if self.groups not in ("kind", "layer"):
            raise CacheOptionError(f"cache_config['groups'] must be 'kind' or 'layer', got {self.groups!r}")
        if not isinstance(self.share_prompts, bool):
            raise CacheOptionTypeError(f"cache_config['share_prompts'] must be a bool, got {self.share_prompts!r}")
        if self.prefill_once is not None and not isinstance(self.prefill_once, bool):
            raise CacheOptionTypeError(f"cache_config['prefill_once'] must be a bool or None, got {self.prefill_once!r}")
        if not isinstance(self.cascade_half_precision, bool):
            raise CacheOptionTypeError(f"cache_config['cascade_half_precision'] must be a bool, got "
                                       f"{self.cascade_half_precision!r}")
        if self.block_tokens is not None and self.layout not in (None, "paged"):
            raise CacheOptionError(f"cache_config['block_tokens'] applies to the paged layout only, not {self.layout!r}")
        if self.paged_kernel not in ("exact", "fused"):
            raise CacheOptionError(f"cache_config['paged_kernel'] must be 'exact' or 'fused', got {self.paged_kernel!r}")
        if self.paged_kernel != "exact" and self.layout not in (None, "paged"):
            raise CacheOptionError(f"cache_config['paged_kernel'] applies to the paged layout only, not {self.layout!r}")
        if self.map_ahead is not None and self.layout != "static":
            raise CacheOptionError("cache_config['map_ahead'] applies to the static layout only")

    def check_layout(self, layout: str | None) -> None:
        """:class:`~hf_vkv.CacheOptionError` for an option of the paged layout (``block_tokens``,
        ``paged_kernel``) given to a cache whose layout, as :func:`hf_vkv.devices.choose_layout`
        decided it from the options and the workload (``None``: the device's contiguous default at
        the first update), is another: the option would do nothing."""
        if layout == "paged":
            return
        given = [key for key in PAGED_KEYS if getattr(self, key) not in (None, "exact")]
        if given:
            raise CacheOptionError(
                f"cache_config[{given[0]!r}] applies to the paged layout only, which the 'vkv_paged' attention reads, "
                f"but this cache's layout is {layout or 'the device default contiguous one'!r}: load the model with "
                f"attn_implementation='vkv_paged' (or model.set_attn_implementation('vkv_paged')), or leave "
                f"{given[0]!r} unset")

    @classmethod
    def from_dict(cls, config: dict[str, Any] | None, *, given_to: str = "cache_config") -> CacheOptions:
        """Parse a ``cache_config`` dict (:func:`config_dict`); transformers' own cache keys are
        translated (:func:`from_transformers_keys`); an unknown key is an error naming the known
        ones and the closest to it, in the words of where it was given (``given_to``: ``"cache_config"``
        of ``generate``, or ``"VKVCache"``'s keyword arguments)."""
        config = from_transformers_keys(config_dict(config))
        removed = sorted(set(config) & set(REMOVED_KEYS))
        if removed:
            raise CacheOptionError(f"cache_config[{removed[0]!r}] is no longer an option: {REMOVED_KEYS[removed[0]]}")
        if PREFIX_STORE_KEY in config:
            raise CacheOptionError(f"cache_config[{PREFIX_STORE_KEY!r}] is read by "
                                   f"generate(cache_implementation='vkv', cache_config={{{PREFIX_STORE_KEY!r}: store}}), "
                                   f"not by VKVCache: a cache made by hand starts from store.lookup(input_ids)")
        known = sorted(f.name for f in fields(cls))
        unknown = sorted(set(config) - set(known))
        if unknown:
            close = {key: difflib.get_close_matches(key, known, n=1) for key in unknown}
            hints = "".join(f"; did you mean {match[0]!r} for {key!r}?" for key, match in close.items() if match)
            where = ("unknown keyword argument(s) {} for VKVCache()" if given_to == "VKVCache"
                     else "unknown cache_config key(s) {} for cache_implementation='vkv'")
            raise CacheOptionError(f"{where.format(unknown)}; known keys: {known}{hints}")
        return cls(**config)


#: ``cache_config`` keys transformers defines for its own caches (``Cache``, ``DynamicCache``,
#: ``StaticCache``, ``QuantizedCache``; older static caches), and what vkv does with each: the
#: vkv key with the same meaning, or ``None`` and what vkv offers instead.
TRANSFORMERS_KEYS: dict[str, tuple[str | None, str]] = {
    "max_cache_len": ("max_tokens", "tokens per row, as StaticCache's capacity"),
    "offloading": (None, "vkv keeps pages on the device of their layer and does not move them to the CPU between "
                         "layers; it bounds the KV memory with 'budget_bytes' and shares pages between rows instead "
                         "(for transformers' offloading use cache_implementation='offloaded')"),
    "offload_only_non_sliding": (None, "it only qualifies 'offloading', which vkv does not offer (see 'offloading')"),
    "backend": (None, "vkv does not quantize: pages hold K/V in the model's dtype; for quantized K/V use "
                      "cache_implementation='quantized'"),
    "nbits": (None, "vkv does not quantize (see 'backend')"),
    "axis_key": (None, "vkv does not quantize (see 'backend')"),
    "axis_value": (None, "vkv does not quantize (see 'backend')"),
    "q_group_size": (None, "vkv does not quantize (see 'backend')"),
    "residual_length": (None, "vkv does not quantize (see 'backend')"),
    "max_batch_size": (None, "vkv takes its rows from generate() (VKVCache(batch_size=...) when built by hand) and "
                             "grows them on demand"),
    "batch_size": (None, "vkv takes its rows from generate() (VKVCache(batch_size=...) when built by hand)"),
    "device": (None, "vkv puts each layer's pages on the device of its first states"),
    "dtype": (None, "vkv stores each layer in the dtype of its first states"),
    "layer_device_map": (None, "vkv puts each layer's pages on the device of its first states"),
}
#: Values of a transformers key that ask for nothing vkv would do differently (accepted, dropped).
_NO_OP_VALUES: dict[str, tuple[Any, ...]] = {"offloading": (False,), "offload_only_non_sliding": (True, False)}


def from_transformers_keys(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with transformers' own cache keys (:data:`TRANSFORMERS_KEYS`) translated: a key
    with vkv's meaning becomes vkv's key (``max_cache_len`` -> ``max_tokens``; both given and
    different is an error), a value that asks for nothing (``offloading=False``;
    ``offload_only_non_sliding`` without offloading) is dropped, and anything else is a
    :class:`~hf_vkv.CacheOptionError` naming the key, saying vkv does not offer it and what it
    offers instead."""
    out = dict(config)
    offloading = out.get("offloading", False)
    for key in [k for k in out if k in TRANSFORMERS_KEYS]:
        value = out.pop(key)
        vkv_key, meaning = TRANSFORMERS_KEYS[key]
        if vkv_key is not None:
            if out.get(vkv_key) not in (None, value):
                raise CacheOptionError(f"cache_config[{key!r}]={value!r} and cache_config[{vkv_key!r}]={out[vkv_key]!r} "
                                       f"disagree: they mean the same ({meaning}); give one")
            out[vkv_key] = value
        elif value in _NO_OP_VALUES.get(key, ()) and not (key == "offload_only_non_sliding" and offloading):
            continue
        else:
            raise CacheOptionError(f"cache_config[{key!r}]={value!r} is a transformers cache option that "
                                   f"cache_implementation='vkv' does not offer: {meaning}")
    return out
