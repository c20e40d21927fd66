"""``VKVCache``: the transformers ``Cache`` whose layers live in virtual-memory layer groups."""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers import PretrainedConfig
from transformers.cache_utils import DYNAMIC_LAYER_TYPE_MAPPING, Cache, get_layer_types_and_kwargs

from ..memory import Arena, BufferStats
from ..devices import UnsupportedDeviceError, arena_for_device
from .group import LayerGroup
from .layer import VKVLayer, VKVSlidingLayer
from .options import CacheOptions, Layout
from .heads import HEAD_MAJOR_PAGE_BYTES, HeadMajorLayerGroup
from .paged import DEFAULT_BLOCK_TOKENS, PagedLayerGroup

__all__ = ["VKVCache", "CacheStats", "GroupStats", "UnsupportedDeviceError"]

_FULL = "full_attention"
_SLIDING = "sliding_attention"


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Memory of one layer group (bytes; a page shared by several rows is counted once)."""

    name: str
    layers: int
    rows: int
    resident_bytes: int  # physical pages this group's rows hold
    token_bytes: int  # bytes of live tokens in them
    shared_pages: int  # pages held by more than one row (or fork)
    cow_copies: int  # pages copied on write so far
    shared_prompt_rows: int  # rows that took their prompt from another row's pages

    @property
    def utilization(self) -> float:
        return self.token_bytes / self.resident_bytes if self.resident_bytes else 1.0


@dataclass(frozen=True, slots=True)
class CacheStats:
    """Memory of a :class:`VKVCache`: per group and in total."""

    groups: tuple[GroupStats, ...]
    pool_resident_bytes: int  # physical bytes held by the cache's arenas (free pages kept for reuse too)

    @property
    def resident_bytes(self) -> int:
        return sum(g.resident_bytes for g in self.groups)

    @property
    def token_bytes(self) -> int:
        return sum(g.token_bytes for g in self.groups)

    @property
    def utilization(self) -> float:
        return self.token_bytes / self.resident_bytes if self.resident_bytes else 1.0

    @property
    def shared_pages(self) -> int:
        return sum(g.shared_pages for g in self.groups)

    @property
    def cow_copies(self) -> int:
        return sum(g.cow_copies for g in self.groups)


def _layer_types(config: PretrainedConfig) -> tuple[list[str], list[dict[str, Any]]]:
    """Layer types and per-layer kwargs on transformers 5.17 (one shared dict) and 5.23+ (a list)."""
    types, kwargs = get_layer_types_and_kwargs(config)
    if isinstance(kwargs, dict):
        kwargs = [dict(kwargs) for _ in types]
    return list(types), list(kwargs)


#: The attention implementation that reads the paged layout (registered on ``import hf_vkv``).
PAGED_ATTENTION = "vkv_paged"


def _layout(options: CacheOptions, config: PretrainedConfig) -> Layout:
    """The layout asked for, or the one the model's attention implementation reads."""
    attn = getattr(config, "_attn_implementation", None)
    if options.layout is None:
        return "paged" if attn == PAGED_ATTENTION else "contiguous"
    if options.layout == "paged" and attn != PAGED_ATTENTION:
        raise ValueError(
            f"cache_config['layout']='paged' is read only by the {PAGED_ATTENTION!r} attention, but the model uses "
            f"{attn!r}: load it with attn_implementation={PAGED_ATTENTION!r} (or call "
            f"model.set_attn_implementation({PAGED_ATTENTION!r})), or leave 'layout' unset"
        )
    return options.layout


class VKVCache(Cache):
    """A KV cache in contiguous virtual memory with pages mapped on demand and shared between rows.

    Pass it as ``past_key_values`` or let ``generate(..., cache_implementation="vkv")`` build it.
    The layout is contiguous (any attention reads the rows as strided tensors) or, when the model's
    attention implementation is ``"vkv_paged"``, paged (rows are block tables; see
    :mod:`hf_vkv.cache.paged`). Full-attention and sliding-window layers get :class:`VKVLayer` / :class:`VKVSlidingLayer`
    (stored in token-major layer groups); other layer kinds (chunked, linear, ...) get
    transformers' own dynamic layers.

    Args:
        config: the model's config (its text/decoder part is used).
        batch_size: rows to reserve (default: the first update's batch).
        prompt_repeats: rows ``r*k .. r*k+k-1`` repeat one prompt (``generate`` expands prompts
            ``max(num_beams, num_return_sequences)`` times); with ``share_prompts`` the prompt's
            pages are stored once for them.
        options / **cache_config: see :class:`CacheOptions`.
    """

    def __init__(
        self,
        config: PretrainedConfig,
        *,
        batch_size: int | None = None,
        prompt_repeats: int = 1,
        max_tokens: int | None = None,
        options: CacheOptions | None = None,
        layer_devices: Mapping[int, torch.device] | None = None,
        **cache_config: Any,
    ) -> None:
        if config is None or not hasattr(config, "get_text_config"):
            raise TypeError("VKVCache needs the model's config: VKVCache(config=model.config)")
        if options is not None and cache_config:
            raise TypeError("pass either options=CacheOptions(...) or cache_config keywords, not both")
        if max_tokens is not None:
            cache_config.setdefault("max_tokens", max_tokens)
        self.options = options or CacheOptions.from_dict(cache_config)
        if prompt_repeats < 1:
            raise ValueError(f"prompt_repeats must be >= 1, got {prompt_repeats}")
        text_config = config.get_text_config(decoder=True)
        self.config = text_config
        self.prompt_repeats = prompt_repeats
        capacity = self.options.max_tokens or getattr(text_config, "max_position_embeddings", None) or 4096
        self._arenas: dict[torch.device, Arena] = {}
        self._groups: dict[tuple[str, int | None, str], LayerGroup] = {}

        self.layout = _layout(self.options, text_config)
        group_type: type[LayerGroup] = LayerGroup
        extra: dict[str, Any] = {}
        if self.layout == "paged":
            if self.options.group_policy == "head":
                raise ValueError("group_policy='head' is a contiguous layout; the paged layout keeps tokens in "
                                 "blocks: use group_policy 'model' or 'layer' with it")
            group_type = PagedLayerGroup
            extra["block_tokens"] = self.options.block_tokens or DEFAULT_BLOCK_TOKENS
        elif self.options.group_policy == "head":
            group_type = HeadMajorLayerGroup
        types, kwargs = _layer_types(text_config)
        layers = []
        members: dict[tuple[str, int | None, str], list[int]] = {}
        for idx, (kind, kw) in enumerate(zip(types, kwargs)):
            if kind in (_FULL, _SLIDING):
                window = kw.get("sliding_window") if kind == _SLIDING else None
                device = str(layer_devices.get(idx, "")) if layer_devices else ""
                key = (kind, window, f"{device}#{idx}" if self.options.group_policy == "layer" else device)
                members.setdefault(key, []).append(idx)
        for key, idxs in members.items():
            kind, window, _ = key
            self._groups[key] = group_type(
                name=f"{kind}" + (f"[{idxs[0]}]" if self.options.group_policy == "layer" else ""),
                members=idxs, sliding_window=window, arena_for=self._arena_for, rows_hint=batch_size,
                capacity=capacity, prompt_repeats=prompt_repeats, share_prompts=self.options.share_prompts, **extra,
            )
        group_of = {i: g for g in self._groups.values() for i in g.members}
        for idx, (kind, kw) in enumerate(zip(types, kwargs)):
            group = group_of.get(idx)
            if group is None:
                layers.append(DYNAMIC_LAYER_TYPE_MAPPING[kind](**kw))
            elif group.sliding_window is not None:
                layers.append(VKVSlidingLayer(group, idx, sliding_window=group.sliding_window))
            else:
                layers.append(VKVLayer(group, idx))
        super().__init__(layers=layers)

    # ----------------------------------------------------------------------------- memory
    def _arena_for(self, device: torch.device) -> Arena:
        device = torch.device(device)
        arena = self._arenas.get(device)
        if arena is None or arena.closed:
            page = self.options.page_bytes
            if page is None and self.options.group_policy == "head" and device.type == "cpu":
                page = HEAD_MAJOR_PAGE_BYTES
            arena = arena_for_device(device, page_bytes=page, budget_bytes=self.options.budget_bytes)
            self._arenas[device] = arena
        return arena

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        """The layer groups (one virtual buffer each)."""
        return tuple(self._groups.values())

    def stats(self) -> CacheStats:
        """Resident and live bytes, sharing and copy-on-write counts, per group and in total."""
        out = []
        for group in self._groups.values():
            s: BufferStats | None = group.stats()
            out.append(GroupStats(
                name=group.name, layers=len(group.members), rows=group.batch,
                resident_bytes=s.resident_bytes if s else 0, token_bytes=s.live_bytes if s else 0,
                shared_pages=s.shared_pages if s else 0, cow_copies=s.cow_copies if s else 0,
                shared_prompt_rows=group.prompt_sharing_rows,
            ))
        pool = sum(a.pool.stats().resident_bytes for a in self._arenas.values() if not a.closed)
        return CacheStats(groups=tuple(out), pool_resident_bytes=pool)

    def check_invariants(self) -> None:
        """Check every group's page tables and pools (see ``hf_vkv.memory``)."""
        for group in self._groups.values():
            if group.buffer is not None and not group.buffer.closed:
                group.buffer.check_invariants()

    # ----------------------------------------------------------------------------- life cycle
    def fork(self) -> VKVCache:
        """A copy that shares every page with this cache (zero bytes copied); each side copies a
        page only when it writes into it. ``copy.deepcopy(cache)`` does the same."""
        other = copy.copy(self)
        other._groups = {key: g.fork(self._arena_for) for key, g in self._groups.items()}
        other.layers = []
        for layer in self.layers:
            if isinstance(layer, VKVLayer):
                group = next(g for g in other._groups.values() if layer.layer_idx in g.slot)
                twin = copy.copy(layer)
                twin._group = group
                group.register(twin)
                other.layers.append(twin)
            else:
                other.layers.append(copy.deepcopy(layer))
        return other

    def __deepcopy__(self, memo: dict[int, Any]) -> VKVCache:
        return self.fork()

    def close(self) -> None:
        """Return every page now (also happens when the cache is garbage-collected)."""
        for group in self._groups.values():
            group.close()
