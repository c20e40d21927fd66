"""``VKVCache``: the transformers ``Cache`` whose layers live in virtual-memory layer groups."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from dataclasses import dataclass
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import (
    DYNAMIC_LAYER_TYPE_MAPPING,
    STATIC_LAYER_TYPE_MAPPING,
    Cache,
    get_layer_types_and_kwargs,
)

from ..config_values import each_layer
from ..kv_records import CASCADE_ATTENTION
from .. import devices
from ..devices import layer_devices_of
from ..memory import Arena, PagePool
from ..memory.errors import ArgumentError, ArgumentTypeError, CacheIndexError
from ..memory.held_pages import HeldPages
from .grad import refuse_trainable_states
from .group import LayerGroup
from .shared_prefix_group import SharedPrefixGroup
from .static_group import StaticGroup
from .hybrid import LinearState, cuts_back_unrecorded, make_vkv_layer, transformers_part
from .layer import (LayerCallError, VKVLayer, VKVSlidingLayer, VKVStaticLayer, int_argument, reorder_rows,
                    repeats_argument, selected_rows)
from . import oom
from .options import CacheOptions, config_dict
from .row_image import GroupImage
from .sources import ArenaSource, LayoutMaker
from .stats import CacheStats, GroupStats, PrefillCounts, ReuseReport

__all__ = ["RowSource", "VKVCache"]


@dataclass(frozen=True, slots=True)
class RowSource:
    """Where :meth:`VKVCache.take_rows` takes a row from: tokens ``start ..`` of row ``row`` of
    ``cache``, placed after ``offset`` tokens of padding."""

    cache: VKVCache | None  # None: the row is all padding (offset >= the length taken)
    row: int = 0
    start: int = 0
    offset: int = 0

#: Layer kinds whose KV vkv stores, and whether they slide (chunked attention keeps, as far as the
#: cache is concerned, a window of ``attention_chunk_size`` tokens, as DynamicCache does).
_VKV_KINDS = {"full_attention": False, "sliding_attention": True, "chunked_attention": True,
              "hybrid": False, "hybrid_sliding": True}  # hybrids: K/V here, linear state in transformers' class


def _layer_types(config: PretrainedConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """Layer types and per-layer kwargs on transformers 5.17 (one shared dict) and 5.23+ (a list)."""
    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        kwargs = [dict(kwargs) for _ in types]
    return list(types), list(kwargs)


def _cross_attention_layers(config: PretrainedConfig) -> frozenset[int]:
    """The decoder layers of ``config`` (a text config) that attend to another sequence and cache
    its K/V (Mllama's ``cross_attention_layers``, which cache the image's tokens at the prefill and
    are only read after): their token count is not the text's, so they never share a layer group
    with the self-attention layers (a group's members write the same tokens in a step)."""
    layers = getattr(config, "cross_attention_layers", None)
    return frozenset(i for i in layers if isinstance(i, int)) if isinstance(layers, (list, tuple)) else frozenset()


def _subrows(config: PretrainedConfig, types: list[str]) -> int | None:
    """(layer, K/V, head) sub-rows of one row in the head-major layout: 2 x the key/value heads of
    every layer vkv stores, layer by layer (``types``: the config's layer types; ``None`` where the
    config names no head count). What the layout rule counts mappings by
    (:func:`hf_vkv.devices.head_major_mappings`); read from the config, before any states are seen."""
    kv, q = each_layer(config, "num_key_value_heads", len(types)), each_layer(config, "num_attention_heads", len(types))
    total = 0
    for kind, k, h in zip(types, kv, q):
        if kind in _VKV_KINDS:
            heads = k or h
            if not isinstance(heads, int) or heads < 1:
                return None
            total += heads
    return 2 * total if total else None


class VKVCache(Cache):
    """A KV cache in virtual memory with pages mapped on demand and shared between rows.

    Pass it as ``past_key_values`` or let ``generate(..., cache_implementation="vkv")`` build it
    (:meth:`for_generate`). Full-attention, sliding-window and chunked layers are stored in layer
    groups (:class:`~hf_vkv.cache.group.LayerGroup`) in the layout of ``options.layout`` (see
    :mod:`hf_vkv.cache.layouts`); other layer kinds (linear attention, recurrent state, ...) keep
    transformers' own layer classes, and :meth:`stats` counts both. In the static (compile) layout
    only full-attention layers are vkv's: a sliding window is bounded, and its layers keep
    transformers' ``StaticSlidingWindowLayer`` (as in a ``StaticCache``).

    Row operations (``reorder_cache``, ``batch_select_indices``, ``batch_repeat_interleave``,
    ``crop``, ``reset``) are done here, once per step: indices are converted once and each group
    is called once (a layer alone in its group does them too, see :class:`VKVLayer`).

    Gradients: in a forward with autograd on, the tokens of that forward carry their history
    (``update`` returns DynamicLayer's ``torch.cat``); tokens cached by earlier forwards are data
    in pages, not autograd history, as a ``StaticCache``'s buffers are (:mod:`hf_vkv.cache.grad`).

    Args:
        config: the model's config (its text/decoder part is used).
        batch_size: rows to reserve (default: the first update's batch).
        prompt_repeats: rows ``r*k .. r*k+k-1`` repeat one prompt (``generate`` expands prompts
            ``max(num_beams, num_return_sequences)`` times); with ``share_prompts`` the prompt's
            pages are stored once for them.
        layer_devices: each layer's device when accelerate spread the model over several.
        memory_of: take physical memory from this cache's arenas (their page size and budget), so
            rows of the two can share pages (:meth:`take_rows`); a prefix store passes its own.
        workload: what the cache will serve (:class:`~hf_vkv.devices.Workload`: device, beams,
            prompt length, compiling), from which :func:`hf_vkv.devices.choose_layout` picks the
            layout when ``options`` name none (``generate`` passes it; default: unknown).
        **options: the fields of :class:`CacheOptions` (what ``cache_config`` holds).

    Besides rows, layouts and page tables it carries three records, plain data: ``prefill_counts``
    (:class:`~hf_vkv.cache.stats.PrefillCounts`, what generate's prefills of repeated prompts did),
    ``reuse`` (:class:`~hf_vkv.cache.stats.ReuseReport`, what prefix reuse did in the last
    ``generate`` call with a store) and ``call`` (the record of the ``generate`` call using the
    cache right now, :class:`hf_vkv.generate.GenerateCall`, set and cleared by that call; ``None``
    outside one). :meth:`stats` reports the first two.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        batch_size: int | None = None,
        prompt_repeats: int = 1,
        layer_devices: Mapping[int, torch.device] | None = None,
        memory_of: VKVCache | None = None,
        workload: devices.Workload | None = None,
        **options: Any,
    ) -> None:
        if config is None or not hasattr(config, "get_text_config"):
            raise ArgumentTypeError("VKVCache needs the model's config: VKVCache(config=model.config)")
        prompt_repeats = int_argument(prompt_repeats, "VKVCache(prompt_repeats)")
        batch_size = None if batch_size is None else int_argument(batch_size, "VKVCache(batch_size)")
        if prompt_repeats < 1:
            raise ArgumentError(f"prompt_repeats must be >= 1, got {prompt_repeats} (1: every row its own prompt)")
        if batch_size is not None and batch_size < 1:
            raise ArgumentError(f"batch_size must be >= 1, got {batch_size} (or None: the first update's batch)")
        self.options = CacheOptions.from_dict(options, given_to="VKVCache")
        text_config = config.get_text_config(decoder=True)
        self.config = text_config
        self.prompt_repeats = prompt_repeats
        self.prefill_counts = PrefillCounts()
        self.reuse: ReuseReport | None = None
        self.call: Any = None  # hf_vkv.generate.GenerateCall while a generate() call uses the cache
        #: Whether a row holds columns an attention mask hid (generate's left padding, or a mask with
        #: zeros): its K/V are not those of its token ids from position 0, so it is no prefix to keep
        #: by hand (``save_prefix`` and ``PrefixStore.insert`` refuse it). Set by ``generate``'s
        #: decoding loop (every mode) and by :meth:`take_rows` with an offset; cleared by :meth:`reset`.
        self.padded = False
        if memory_of is not None and not isinstance(memory_of, VKVCache):
            raise ArgumentTypeError(f"memory_of must be a VKVCache (or None), got {type(memory_of).__name__}")
        types, kwargs = _layer_types(text_config)  # (transformers' config lookups: ~1 ms, once)
        workload = workload or devices.Workload()
        workload = dataclasses.replace(
            workload, attention=getattr(text_config, "_attn_implementation", None),
            inherited=None if memory_of is None else memory_of._layout_name or "contiguous",
            rows=workload.rows if workload.rows is not None else batch_size,
            subrows=workload.subrows if workload.subrows is not None else _subrows(text_config, types))
        self._layout_name = devices.choose_layout(self.options.layout, workload)
        self.options.check_layout(self._layout_name)
        capacity = self.options.max_tokens or getattr(text_config, "max_position_embeddings", None) or 4096
        # memory_of: draw pages from that cache's arenas, so rows can share pages with it (a prefix store)
        self._arena_for = memory_of._arena_for if memory_of is not None else \
            ArenaSource(page_bytes=self.options.page_bytes, budget_bytes=self.options.budget_bytes)
        self._arenas = self._arena_for.arenas

        members: dict[tuple[str, int | None, str], list[int]] = {}
        static = self._layout_name == "static"
        cross = _cross_attention_layers(text_config)
        for idx, (kind, kw) in enumerate(zip(types, kwargs)):
            # the static layout pages full-attention layers; a sliding window is bounded, so in a
            # compiled step it stays transformers' StaticSlidingWindowLayer (the same as StaticCache's)
            if kind in _VKV_KINDS and not (static and kind != "full_attention"):
                window = kw.get("sliding_window") if _VKV_KINDS[kind] else None
                device = str(layer_devices.get(idx, "")) if layer_devices else ""
                # a cross-attention layer caches the image's tokens once, not the text's: a group of its own
                group_kind = "cross_attention" if idx in cross else "sliding_attention" if window else "full_attention"
                key = (group_kind, window, f"{device}#{idx}" if self.options.groups == "layer" else device)
                members.setdefault(key, []).append(idx)
        self._groups: list[LayerGroup] = []

        make_layout = LayoutMaker(self._layout_name, self.options.block_tokens, text_config, self.options.paged_kernel)
        # under "vkv_cascade", full-attention groups of a contiguous layout tag shared prefixes
        cascade = getattr(text_config, "_attn_implementation", None) == CASCADE_ATTENTION \
            and self._layout_name not in ("static", "paged")
        for (kind, window, _), idxs in members.items():
            common = dict(name=f"{kind}" + (f"[{idxs[0]}]" if self.options.groups == "layer" else ""),
                          members=idxs, sliding_window=window, make_layout=make_layout, arena_for=self._arena_for,
                          rows_hint=batch_size, capacity=capacity, prompt_repeats=prompt_repeats,
                          share_prompts=self.options.share_prompts)
            if static:
                self._groups.append(StaticGroup(map_ahead=self.options.map_ahead or devices.MAP_AHEAD_TOKENS, **common))
            elif cascade and kind == "full_attention":
                self._groups.append(SharedPrefixGroup(half_precision=self.options.cascade_half_precision, **common))
            else:
                self._groups.append(LayerGroup(**common))
        group_of = {i: g for g in self._groups for i in g.members}
        layers: list[Any] = []
        for idx, (kind, kw) in enumerate(zip(types, kwargs)):
            group = group_of.get(idx)
            if group is None:
                layers.append(STATIC_LAYER_TYPE_MAPPING[kind](max_cache_len=capacity, **kw) if static
                              else DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            elif static:
                layers.append(VKVStaticLayer(group, idx))
            else:
                layers.append(make_vkv_layer(kind, group, idx, kw))
        super().__init__(layers=layers)

    @staticmethod
    def layer_kinds(config: PretrainedConfig) -> list[str]:
        """The distinct layer kinds of ``config``'s (decoder) model, in order of first use, as
        transformers names them (``"full_attention"``, ``"linear_attention"``, ...)."""
        types, _ = _layer_types(config.get_text_config(decoder=True))
        return list(dict.fromkeys(types))

    @staticmethod
    def cross_attention_layers(config: PretrainedConfig) -> frozenset[int]:
        """The decoder layers of ``config``'s model that cache another sequence's K/V (Mllama's
        cross-attention layers: the image's tokens, at the prefill): a layer group of their own,
        empty after a text-only call."""
        return _cross_attention_layers(config.get_text_config(decoder=True))

    @staticmethod
    def stores_kv(config: PretrainedConfig) -> bool:
        """Whether any layer of ``config``'s model keeps K/V that vkv stores."""
        return any(kind in _VKV_KINDS for kind in VKVCache.layer_kinds(config))

    @classmethod
    def for_generate(cls, model: Any, *, batch_size: int, expand: int, max_length: int,
                     cache_config: Mapping[str, Any] | None, num_beams: int = 1,
                     prompt_tokens: int | None = None, compiling: bool = False,
                     memory_of: VKVCache | None = None, max_cache_len: int | None = None) -> VKVCache:
        """The cache ``generate(..., cache_implementation="vkv")`` builds (and the A/B harness).

        Rows: ``batch_size * expand`` (``expand = max(num_beams, num_return_sequences)``, the
        rows sharing each prompt). Tokens: ``cache_config['max_tokens']``, else room for the
        model's whole context and at least ``max_length`` — only address space, so the returned
        cache can be passed back to ``generate()`` to continue; in the static layout (whose
        attention reads the whole capacity, as StaticCache's) ``max_length``, or ``max_cache_len``
        (``generate``'s, transformers' ceiling for static caches) where larger, or the largest
        capacity an earlier static call of ``model`` had, as transformers sizes its StaticCache
        (StaticCache's sums over the capacity, bit for bit). Layout:
        :func:`hf_vkv.devices.choose_layout` of ``cache_config['layout']`` and the call's workload
        (the model's device, ``num_beams``, ``prompt_tokens``, ``compiling``, the memory's).
        """
        options = config_dict(cache_config)
        device = devices.model_device(model)
        workload = devices.Workload(device_type=None if device is None else device.type, num_beams=num_beams,
                                    prompt_tokens=prompt_tokens, compiling=compiling, prompt_repeats=expand,
                                    item_bytes=devices.subrow_item_bytes(model.config.get_text_config(decoder=True), model.dtype),
                                    # the most a row writes after its prompt (beams' mappings grow with it: rule 7)
                                    new_tokens=None if prompt_tokens is None else max(max_length - prompt_tokens, 0))
        if options.get("layout") == "static" or (options.get("layout") is None and compiling):
            # as transformers sizes its StaticCache in generate: the largest capacity a static call of this model had
            # (it keeps it in model._previous_max_cache_length, against recompiling), which the attention reads whole
            asked = options.get("max_tokens") or max(max_length - 1, max_cache_len or 0)
            options["max_tokens"] = max(asked, getattr(model, "_previous_max_cache_length", -1))
            model._previous_max_cache_length = options["max_tokens"]
        elif options.get("max_tokens") is None:
            context = getattr(model.config.get_text_config(decoder=True), "max_position_embeddings", None) or 0
            options["max_tokens"] = max(max_length, context)
        return cls.from_cache_config(model.config, options, batch_size=batch_size * expand, prompt_repeats=expand,
                                     layer_devices=layer_devices_of(model), memory_of=memory_of, workload=workload)

    @classmethod
    def from_cache_config(cls, config: PretrainedConfig, cache_config: Mapping[str, Any] | None,
                          **kwargs: Any) -> VKVCache:
        """``VKVCache(config, **kwargs, **cache_config)`` for options a user gave as a
        ``cache_config`` dict (``generate``, :class:`~hf_vkv.PrefixStore`, :func:`~hf_vkv.load_prefix`):
        a wrong key is refused in ``cache_config``'s words, before anything is made."""
        options = config_dict(cache_config)
        CacheOptions.from_dict(options)
        return cls(config, **kwargs, **options)

    # ----------------------------------------------------------------------------- layout and memory
    @property
    def layout(self) -> str | None:
        """The layout's name: as asked for, or once the first update chose the device's default
        (``None`` before that)."""
        if self._layout_name is not None:
            return self._layout_name
        return next((g.layout.name for g in self._groups if g.layout is not None), None)

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups (one row buffer each)."""
        return tuple(self._groups)

    @property
    def rows(self) -> int:
        """Rows (batch) the cache holds now (0 before the first update)."""
        return max((g.batch for g in self._groups), default=0) or max(0, self.batch_size)

    def on_memory_full(self, reclaim: Callable[[int, PagePool], bool] | None) -> None:
        """Who lets pages go when a step of this cache, or of any cache drawing from its memory
        (``memory_of=``), finds the budget full: ``reclaim(pages, pool)`` is called with the pages
        the step needs after the step rolled back, and returns whether it let any go (the step is
        then tried again; else it raises :class:`KVCacheOutOfMemory`). A prefix store sets it on its
        memory: its least recently used entries go before a call fails."""
        self._arena_for.reclaim = reclaim

    def slides(self) -> bool:
        """Whether a layer group of this cache keeps a sliding window (its pages behind the window
        are dropped: such a row cannot be cut back, copied to another offset or serve a shorter prefix)."""
        return any(group.sliding_window is not None for group in self._groups)

    def reserved_tokens(self) -> int | None:
        """Tokens a row has room for in every group (the smallest reservation; a sliding group
        drops its pages behind the window, but its tokens still take addresses of its reservation);
        ``None`` for a cache without groups."""
        rooms = [group.capacity for group in self._groups]
        return min(rooms) if rooms else None

    def bytes_at_most(self, *, rows: int, tokens: int) -> int | None:
        """Bytes ``rows`` rows of this cache hold at most at ``tokens`` tokens each, no page shared
        (sliding windows at their reservation): what a memory budget must hold for them beside
        what else draws from it. Groups not written yet (no states, so no size) are not counted;
        ``None`` where a group's layout does not say (the paged layout's blocks)."""
        each = [oom.bytes_at_most(group, rows, tokens) for group in self._groups]
        return None if None in each else sum(each)

    def transformers_layers(self) -> list[Any]:
        """Layers kept in transformers' own classes, and the linear state of hybrid layers (their
        K/V are a group's): what row operations reach besides the groups."""
        return [part for part in map(transformers_part, self.layers) if part is not None]

    def _vkv_layers(self) -> int:
        """Layers whose K/V vkv stores (a hybrid layer's attention part counts)."""
        return sum(len(group.members) for group in self._groups)

    def stats(self) -> CacheStats:
        """Resident and live bytes, sharing and copy-on-write counts, per group and in total."""
        out = []
        for group in self._groups:
            s = group.stats()
            out.append(GroupStats(
                name=group.name, layout=None if group.layout is None else group.layout.name,
                layers=len(group.members), rows=group.batch,
                resident_bytes=s.resident_bytes if s else 0, token_bytes=s.live_bytes if s else 0,
                shared_pages=s.shared_pages if s else 0, cow_copies=s.cow_copies if s else 0,
                shared_prompt_rows=group.prompts.rows, tail_copies=s.tail_copies if s else 0,
                mappings=s.mappings if s else 0,
            ))
        pool = sum(a.pool.stats().resident_bytes for a in self._arenas.values() if not a.closed)
        others = len(self.transformers_layers())
        return CacheStats(groups=tuple(out), pool_resident_bytes=pool, vkv_layers=self._vkv_layers(),
                          transformers_layers=others, prompt_tokens_computed=self.prefill_counts.computed,
                          prompt_tokens_saved=self.prefill_counts.saved, prefill_once=self.prefill_counts.verdict,
                          reuse=None if self.reuse is None else dataclasses.replace(self.reuse),
                          cascade=next((g.cascade for g in self._groups if isinstance(g, SharedPrefixGroup)), "not asked"))

    def __repr__(self) -> str:
        others = len(self.transformers_layers())
        return (f"VKVCache(layout={self.layout or 'device default'}, vkv_layers={self._vkv_layers()} "
                f"in {len(self._groups)} group(s), transformers_layers={others}, rows={self.rows})")

    def check_invariants(self) -> None:
        """Check every group's rows, page tables and pools (see ``hf_vkv.memory``)."""
        for group in self._groups:
            group.check_invariants()

    def check_reads(self) -> None:
        """Raise :class:`~hf_vkv.memory.errors.CacheOptionError` where the last forward's attention
        did not get what a layer's update returned and the layout cannot serve that
        (:meth:`~hf_vkv.cache.layouts.base.Layout.check_read`: the fused paged kernel). A forward's
        other layers are checked at the next update of their group; ``generate`` checks the rest
        when its loop returns."""
        for group in self._groups:
            if group.layout is not None:
                group.layout.check_read()

    # ----------------------------------------------------------------------------- repeated prompts
    def rows_repeat_prompts(self) -> bool:
        """Whether rows ``r*k .. r*k+k-1`` (``k`` = :attr:`prompt_repeats`) hold the same pages
        (so equal tokens) in every group: rows :meth:`take_rows` started from stored prefixes."""
        k = self.prompt_repeats
        if self.transformers_layers() or self.rows % k:
            return False
        for group in self._groups:
            if group.buffer is None:
                return False
            for leader in range(0, self.rows, k):
                length = group.buffer.length(leader)
                if any(group.buffer.shared_items(leader, r) < length for r in range(leader + 1, leader + k)):
                    return False
        return True

    @contextlib.contextmanager
    def prompts_alone(self) -> Iterator[None]:
        """Inside, a prefill's rows are distinct prompts (one row per prompt: no prompt sharing
        among them, whatever :attr:`prompt_repeats` says)."""
        with contextlib.ExitStack() as alone:
            for group in self._groups:
                alone.enter_context(group.prompts.alone())
            yield

    def count_shared_prompt_rows(self, rows: int) -> None:
        """``rows`` more rows took their prompt from another row's pages (``stats()``)."""
        for group in self._groups:
            group.prompts.shared_rows += rows

    # ----------------------------------------------------------------------------- stored prefixes
    def take_rows(self, sources: Sequence[RowSource], *, length: int) -> int:
        """Fill this empty cache with ``len(sources)`` rows of ``length`` tokens taken from other
        caches: row ``i`` holds zeros at ``[0, sources[i].offset)`` (left padding; masked, never
        attended) and then tokens ``[start, start + length - offset)`` of row ``sources[i].row``
        of ``sources[i].cache``. Pages are shared (nothing copied) where the source draws from
        this cache's memory (``memory_of``), has the same layout, and ``start == offset == 0``;
        rows with the same source share each other's pages; any other row is copied (left
        padding places a prefix at an unaligned offset). Returns the rows copied.

        Caches whose every layer vkv keeps (a layer kept by transformers or the static layout is a
        ``ValueError``, as is a cache that holds tokens or a source shorter than asked). Sliding
        layers take shared rows only, whose sources still hold their window
        (:meth:`LayerGroup.take_rows`)."""
        if self.get_seq_length() or self.rows:
            raise ArgumentError("take_rows fills an empty cache; this one holds rows (call it on a new VKVCache)")
        if self.transformers_layers() or self._layout_name == "static":
            raise ArgumentError("take_rows fills caches whose every layer vkv keeps (no layer kept by transformers, "
                                "not the static layout)")
        length = int_argument(length, "take_rows(length)")
        if not sources or length < 1:
            raise ArgumentError(f"take_rows needs rows and length >= 1, got {len(sources)} rows of {length}")
        for src in sources:
            if src.offset < length:
                if not isinstance(src.cache, VKVCache) or len(src.cache.groups) != len(self._groups):
                    raise ArgumentTypeError(f"a row source must be a VKVCache of the same model, got "
                                            f"{type(src.cache).__name__}")
                held = src.cache.get_seq_length()
                if src.start < 0 or src.offset < 0 or src.start + length - src.offset > held \
                        or not 0 <= src.row < src.cache.rows:
                    raise ArgumentError(f"row source {src} asks for tokens its cache ({held} tokens, {src.cache.rows} "
                                        f"rows) does not hold: take rows 0..{src.cache.rows - 1} and start + "
                                        f"length - offset <= {held}")
        per_group = [[(None if s.offset >= length else s.cache._groups[g], s.row, s.start, s.offset) for s in sources]
                     for g in range(len(self._groups))]
        taken: list[int] = []  # a group no source holds tokens of stays empty (Mllama's cross-attention, text only)
        for g, group_sources in enumerate(per_group):
            held = [(src, s.cache.get_seq_length()) for (src, *_), s in zip(group_sources, sources)
                    if src is not None and any(src.lengths)]
            if any(n != seq for src, seq in held for n in src.lengths):
                raise ArgumentError(f"group {self._groups[g].name!r} of a source holds other tokens than its cache's "
                                    f"{held[0][1]}: it caches another sequence (cross-attention), whose rows take_rows "
                                    f"cannot take")
            if held:
                taken.append(g)
        copied = 0
        # sliding groups first: one that cannot share its rows refuses before any group took a row
        for g in sorted(taken, key=lambda g: self._groups[g].sliding_window is None):
            copied = self._groups[g].take_rows(per_group[g], length)
        filled = [self._groups[g] for g in taken]
        for layer in self.layers:
            if isinstance(layer, VKVLayer) and any(layer.group is group for group in filled):
                layer.adopt_group()
        self.padded = self.padded or any(s.offset > 0 for s in sources)  # (set by generate before, for its mask)
        return copied

    def take_over(self, other: VKVCache) -> None:
        """Hold batch-1 ``other``'s row by taking its buffers (its reservations and pages move
        here: no page is mapped, copied or unmapped), leaving ``other`` empty; ``other`` must not be
        used for tokens again (close it). For a cache that continues a row another cache computed
        (a prefix store's entry). This cache must be empty and of the same model, layouts, memory
        and at most ``other``'s capacity; full-attention vkv layers only. Raises ``ValueError``
        (nothing changed) otherwise."""
        if self.get_seq_length() or self.rows:
            raise ArgumentError("take_over fills an empty cache; this one holds rows (call it on a new VKVCache)")
        if not isinstance(other, VKVCache) or other.rows != 1 or len(other._groups) != len(self._groups) \
                or self.transformers_layers() or other.transformers_layers() or self._layout_name == "static":
            raise ArgumentError("take_over takes the one row of a batch-1 cache of the same model whose every layer "
                                "vkv keeps (not the static layout)")
        for group, src in zip(self._groups, other._groups):
            group.check_take_over(src)
        for group, src in zip(self._groups, other._groups):
            group.take_over(src)
        for layer in self.layers:
            if isinstance(layer, VKVLayer):
                layer.adopt_group()
        self.padded = other.padded

    def cut_to(self, length: int) -> None:
        """Keep at most the first ``length`` tokens of every layer, whatever each holds (a
        forward that raised part-way leaves layers holding different counts; :meth:`crop` removes
        the same count from each). Full-attention vkv layers only (``ValueError`` otherwise,
        nothing changed)."""
        if length < 0 or self.transformers_layers() or self.slides():
            raise ArgumentError(f"cut_to keeps a length >= 0 of caches whose every layer vkv keeps, with full "
                                f"attention (got length {length}; crop() cuts the same count from every layer of any "
                                f"cache)")
        self._row_operation("cut_to", lambda group: group.cut_to(length), lambda layer: None)

    # ----------------------------------------------------------------------------- row images
    def row_images(self) -> list[GroupImage]:
        """This batch-1 cache's row as page tables, one :class:`GroupImage` per layer group (what
        a mapped prefix file records). Full-attention caches of vkv layers only (``ValueError``
        otherwise: a sliding window, a layer kept by transformers, another layout's group)."""
        if self.rows != 1 or self.transformers_layers():
            raise ArgumentError(f"row images are of batch-1 caches whose every layer vkv keeps (this one holds "
                                f"{self.rows} rows: batch_select_indices one row of a fork first)")
        return [group.row_image() for group in self._groups]

    def arena_for_images(self, images: Sequence[GroupImage]) -> Arena:
        """The one arena this empty cache would hold ``images`` in (see :meth:`install_row`);
        ``ValueError`` if they do not fit its groups or would need several arenas."""
        if len(images) != len(self._groups):
            raise ArgumentError(f"{len(images)} group images for a cache of {len(self._groups)} groups: give one "
                                f"image per group, from a cache of the same model and options")
        arenas = {id(a): a for a in (g.arena_for_image(i) for g, i in zip(self._groups, images))}
        if len(arenas) != 1:
            raise ArgumentError(f"the images would live in {len(arenas)} arenas (one per device and page size): "
                                f"give images of one device and page size")
        return next(iter(arenas.values()))

    def install_row(self, images: Sequence[GroupImage]) -> None:
        """Fill this empty cache with one row held by ``images``' page tables (one per group,
        pages in use in :meth:`arena_for_images`'s arena, e.g. a mapped file's): no bytes move.
        Raises ``ValueError`` if the cache holds tokens or an image does not fit."""
        if self.get_seq_length() or self.rows:
            raise ArgumentError("install_row fills an empty cache; this one holds rows (call it on a new VKVCache)")
        self.arena_for_images(images)
        for group, image in zip(self._groups, images):
            group.install_row(image)
        for layer in self.layers:
            if isinstance(layer, VKVLayer):
                layer.adopt_group()

    # ----------------------------------------------------------------------------- static layout
    def map_ahead(self, tokens: int | None = None) -> None:
        """Static layout, before a (compiled) step: make the next ``tokens`` tokens of every row
        writable — pages mapped and private — so the step writes only with ``index_copy_``
        (at least ``cache_config['map_ahead']``, default :data:`hf_vkv.devices.MAP_AHEAD_TOKENS`).
        Called by ``generate`` before each step and after every row operation that changed a page
        table (a reorder that moved only bytes left every page as it was); a no-op for the
        other layouts (:class:`~hf_vkv.cache.static_group.StaticGroup`)."""
        for group in self._groups:
            if isinstance(group, StaticGroup):
                group.map_ahead(tokens)

    # ----------------------------------------------------------------------------- row operations
    def _row_operation(self, call: str, on_group: Callable[[LayerGroup], None],
                       on_layer: Callable[[Any], None]) -> None:
        """Apply the row operation ``call`` once to each group and to each layer kept by
        transformers; :class:`~hf_vkv.cache.layer.LayerCallError` first, changing nothing, where
        such a layer has no ``call`` (transformers' linear-attention layers select and repeat no rows)."""
        lacking = sorted({type(layer).__name__ for layer in self.transformers_layers()
                          if not callable(getattr(layer, call, None))})
        if lacking:
            raise LayerCallError(
                f"{call}: this model's cache keeps layers of transformers' {', '.join(lacking)}, which have no "
                f"{call} (a DynamicCache of this model cannot do it either); nothing was changed")
        for group in self._groups:
            group.before_row_operation()
        for group in self._groups:
            on_group(group)
        for layer in self.transformers_layers():
            on_layer(layer)
        for group in self._groups:
            group.after_row_operation()

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` takes row ``beam_idx[i]``'s pages (``beam_idx``: int tensor, any device): no copy."""
        index = reorder_rows(beam_idx)  # one host transfer for every group
        for group in self._groups:  # every group first: a refused reorder changes nothing
            group.check_index(index, "reorder_cache(beam_idx)")
        self._row_operation("reorder_cache", lambda group: group.reorder(index),
                            lambda layer: layer.reorder_cache(beam_idx))

    def batch_select_indices(self, indices: torch.Tensor | Sequence[int]) -> None:
        """Keep only the rows ``indices`` (row numbers, negative ones, a bool mask, a tensor or a
        sequence of them), as ``DynamicCache`` selects its batch dimension."""
        index = selected_rows(indices, self.rows)
        for group in self._groups:  # every group first: a refused selection changes nothing
            group.check_index(index, "batch_select_indices(indices)")
        self._row_operation("batch_select_indices", lambda group: group.reorder(index),
                            lambda layer: layer.batch_select_indices(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, consecutively (pages shared, nothing copied)."""
        repeats = repeats_argument(repeats)
        self._row_operation("batch_repeat_interleave", lambda group: group.repeat_rows(repeats),
                            lambda layer: layer.batch_repeat_interleave(repeats))

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int, as for DynamicCache);
        sliding layers then hold their window again (``crop(0)`` too)."""
        # transformers 5.17's assisted decoding passes a 0-d tensor
        tokens_to_remove = int_argument(tokens_to_remove, "crop(tokens_to_remove)")
        if tokens_to_remove > 0:
            raise ArgumentError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        for group in self._groups:
            group.before_row_operation()
        for group in self._groups:
            group.check_crop(tokens_to_remove)  # every group first: a refused crop changes nothing
        layers = self.transformers_layers()
        for layer in layers:
            if isinstance(layer, LinearState):
                layer.check_crop(tokens_to_remove)  # every linear state first, as the groups
        for layer in layers:
            layer.crop(tokens_to_remove)  # transformers' layers may refuse too: before the groups change
        for group in self._groups:
            group.crop(tokens_to_remove)
        for group in self._groups:
            group.after_row_operation()

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """``Cache.update``, with a ``layer_idx`` outside the model's layers refused
        (:class:`~hf_vkv.memory.errors.CacheIndexError`, nothing changed)."""
        n = len(self.layers)
        layer_idx = int_argument(layer_idx, "update(layer_idx)")
        if not -n <= layer_idx < n:
            raise CacheIndexError(f"update: layer_idx {layer_idx} is not a layer of this cache: it has {n} layers, "
                                  f"0..{n - 1} (a cache serves the model whose config made it)")
        if not isinstance(key_states, torch.Tensor) or not isinstance(value_states, torch.Tensor):
            raise ArgumentTypeError(f"update takes key and value states as tensors [batch, heads, tokens, head_dim], "
                                    f"got {type(key_states).__name__} and {type(value_states).__name__}")
        return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    def reset(self) -> None:
        """Forget every cached token (pages go back to the pool)."""
        self._row_operation("reset", LayerGroup.clear, lambda layer: layer.reset())
        self.padded = False

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep sliding layers' pages behind the window until :meth:`crop` (assisted decoding).
        ``kwargs`` go to the layers transformers keeps (from transformers 5.25,
        ``recurrent_states_to_keep``: how many past recurrent states a linear state records)."""
        for group in self._groups:
            group.start_recording()
        for layer in self.transformers_layers():
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording(**kwargs)

    # ----------------------------------------------------------------------------- prefixes
    def write_states(self, layer_idx: int, key_states: torch.Tensor, value_states: torch.Tensor, *,
                     start: int = 0) -> None:
        """Store ``[B, H, T, D]`` states as tokens ``[start, start + T)`` of an empty layer, with no
        attention run (a prefix restored from a file). ``start > 0`` only for a sliding layer
        whose window is all that was kept: tokens before it are not held."""
        n = len(self.layers)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < n:
            raise CacheIndexError(f"write_states: layer_idx {layer_idx!r} is not a layer of this cache: it has {n} "
                                  f"layers, 0..{n - 1}")
        layer = self.layers[layer_idx]
        start = int_argument(start, "write_states(start)")
        if start < 0:
            raise ArgumentError(f"write_states: start must be >= 0, got {start}")
        if not isinstance(layer, VKVLayer):
            if start:
                raise ArgumentError(f"layer {layer_idx} is kept by transformers' own class: it takes states from "
                                    f"token 0 (pass start=0)")
            layer.update(key_states, value_states)
            return
        refuse_trainable_states(key_states, value_states, layer_idx=layer_idx, stored_only=True)
        if start and not isinstance(layer, VKVSlidingLayer):
            raise ArgumentError(f"layer {layer_idx} is full attention: its states start at token 0, not {start} "
                                f"(pass start=0 with every token)")
        if not layer.is_initialized:
            layer.lazy_initialization(key_states, value_states)
        layer.group.write_states(layer_idx, key_states, value_states, start=start)

    def min_prefix_length(self) -> int:
        """The shortest prefix :meth:`fork` can cut this cache back to (0: any length). A sliding
        layer serves a prefix of ``m`` tokens only while tokens ``[m - window + 1, m)`` are held."""
        length = self.get_seq_length()
        m = 0
        for group in self._groups:
            first = group.first_written()
            if group.sliding_window is not None and first > 0:
                m = max(m, first + group.sliding_window - 1)
        if not all(map(cuts_back_unrecorded, self.transformers_layers())):
            m = length  # transformers' own sliding layers and recurrent states cannot be cut back
        return min(m, length)

    def held_pages(self) -> HeldPages:
        """Every physical page the cache holds (a page shared with a fork is the same page of the
        same store in both, so :class:`~hf_vkv.memory.held_pages.PageCounts` counts it once), plus
        the K/V tensors of layers kept in transformers' own classes."""
        tensors: dict[Hashable, int] = {}
        for layer in self.transformers_layers():
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    tensors[("tensor", id(layer), t.data_ptr())] = t.numel() * t.element_size()
        return HeldPages.of([held for group in self._groups if (held := group.held_pages()) is not None], tensors)

    # ----------------------------------------------------------------------------- life cycle
    def fork(self, length: int | None = None) -> VKVCache:
        """A copy that shares every page with this cache (zero bytes copied); each side copies a
        page only when it writes into it. ``copy.deepcopy(cache)`` does the same.

        ``length``: the copy holds only the first ``length`` tokens (in
        ``[max(min_prefix_length(), 1), get_seq_length()]``; ``ValueError`` otherwise). Cutting a
        sliding layer that has passed its window back keeps its pages behind the window from
        then on (transformers' rule for ``crop``)."""
        if length is None:
            return self._fork()
        length = int_argument(length, "fork(length)")
        n = self.get_seq_length()
        floor = self.min_prefix_length()
        if not 0 < length <= n or length < floor:
            why = (" (sliding-window layers dropped the pages behind their window, or a recurrent state cannot be "
                   "cut back)") if floor > 1 else ""
            raise ArgumentError(
                f"fork(length={length}): cannot cut a cache of {n} tokens back to {length}: it serves prefixes of "
                f"{max(floor, 1)}..{n} tokens{why}; pass a length in that range, or none for the whole cache"
                if n else f"fork(length={length}): the cache holds no tokens; fork() without a length copies it"
            )
        fork = self._fork()
        try:
            if length < n:
                fork.activate_past_recording()
                fork.crop(length - n)
        except BaseException:
            fork.close()
            raise
        return fork

    def _fork(self) -> VKVCache:
        other = copy.copy(self)
        other.prefill_counts = dataclasses.replace(self.prefill_counts)
        other.reuse = None if self.reuse is None else dataclasses.replace(self.reuse)
        other.call = None
        twins = {id(g): g.fork(other._arena_for) for g in self._groups}
        other._groups = [twins[id(g)] for g in self._groups]
        other.layers = []
        for layer in self.layers:
            if isinstance(layer, VKVLayer):
                other.layers.append(layer.twin(twins[id(layer.group)]))
            else:
                other.layers.append(copy.deepcopy(layer))
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> VKVCache:
        return self._fork()

    def __copy__(self) -> VKVCache:
        """A second handle on the same groups and pages (what :meth:`_fork` starts from)."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        return other

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise ArgumentTypeError(
            "a VKVCache holds memory mapped in this process and is not pickled (pickle, torch.save): "
            "copy.deepcopy(cache) forks it here (its pages shared), hf_vkv.save_prefix(path, cache, token_ids) "
            "writes its K/V to a file that hf_vkv.load_prefix reads in any process, and a PrefixStore saves its "
            "entries with store.save(folder)")

    def check_process(self, what: str = "this cache") -> None:
        """Raise :class:`~hf_vkv.memory.process.ForkedMemoryError` (naming ``what``) where this
        cache's memory was made in another process: a child forked after it was made, whose
        writes would land in that process's pages (:mod:`hf_vkv.memory.process`)."""
        for arena in self._arenas.values():
            if not arena.closed:
                arena.made_in.check(what)

    def close(self) -> None:
        """Return every page now (also happens when the cache is garbage-collected)."""
        for group in self._groups:
            group.close()
