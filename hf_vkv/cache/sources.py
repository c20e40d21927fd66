"""What a cache's layer groups call to make their layout and to get physical memory.

Both are small objects owned by the :class:`~hf_vkv.cache.VKVCache` and handed to its groups, and
neither refers back to the cache: a group holding the cache's bound methods made a reference cycle
(cache -> layers -> group -> cache), so a dead cache kept its pages, memfds and mappings until the
cycle collector ran. Now the last reference to a cache releases everything at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from ..config_values import layer_values
from ..devices import arena_for_device, policy_for
from ..memory import Arena, PagePool
from ..memory.errors import CacheOptionError
from .geometry import GroupGeometry
from .. import devices
from .layouts import HeadMajorLayout, Layout, PagedLayout, StaticLayout, TokenMajorLayout, layout_class

__all__ = ["ArenaSource", "LayoutMaker"]

_OWN_ATTENTION = frozenset({"vkv_paged", "vkv_cascade"})  # vkv's kernels, which read its layouts themselves
#: Off the host, attention implementations whose result does not depend on the strides of the K/V they read.
_STRIDE_EXACT_ATTENTION = _OWN_ATTENTION | {"sdpa", "flash_attention_2", "flash_attention_3"}
#: On the host, those whose result does not depend on the strides of aligned K/V views (SDPA's CPU
#: kernels, one query a row: 0 of 960 random draws apart over head dims 16-256 in float32,
#: bfloat16 and float16, token strides of one to five layers' tokens, padding masks or none, 1 and
#: 2 threads; a misaligned head dim, 50 in float32, 22 of 50 apart: :func:`views_misaligned`).
_HOST_STRIDE_EXACT_ATTENTION = _OWN_ATTENTION | {"sdpa"}


def views_misaligned(config: PretrainedConfig, geometry: GroupGeometry) -> bool:
    """Whether a contiguous layout's views would start some (row, head) of keys or values at
    another alignment than DynamicCache's contiguous tensors do, so that attention could round
    differently (:data:`hf_vkv.devices.VIEW_ALIGNMENT_BYTES`): a head's token of keys or values is
    not a multiple of that many bytes, and the attention is not one of vkv's own kernels (which
    read the layouts themselves). Then the layouts hand attention contiguous copies."""
    attention = getattr(config, "_attn_implementation", None) or "eager"
    size = geometry.dtype.itemsize
    return attention not in _OWN_ATTENTION and any(dim * size % devices.VIEW_ALIGNMENT_BYTES
                                                   for dim in (geometry.key_dim, geometry.value_dim))


def reads_need_contiguous(config: PretrainedConfig, geometry: GroupGeometry) -> bool:
    """Whether the model's attention must get contiguous K/V to compute exactly as on
    DynamicCache's (see :meth:`TokenMajorLayout.attention_inputs`): any attention but vkv's own
    where the views are misaligned (:func:`views_misaligned`: SDPA's CPU kernels read a head dim
    of 50 float32 values through token-strided views in another order, decode logits ~1e-7 apart);
    on the host, every attention but SDPA and vkv's own (:data:`_HOST_STRIDE_EXACT_ATTENTION`:
    eager's matmul over token-strided keys drifts; the others are not measured); on other
    devices, a matmul over the returned tensors themselves (eager and other non-fused attention)
    with one key/value head per query head."""
    attention = getattr(config, "_attn_implementation", None) or "eager"
    if views_misaligned(config, geometry):
        return attention not in _OWN_ATTENTION
    if geometry.device.type == "cpu":
        return attention not in _HOST_STRIDE_EXACT_ATTENTION
    heads = set(layer_values(config, "num_attention_heads"))  # unknown where the layers differ: contiguous
    return attention not in _STRIDE_EXACT_ATTENTION and (len(heads) > 1 or heads == {geometry.kv_heads})


@dataclass(frozen=True, slots=True)
class LayoutMaker:
    """Makes a group's layout from its geometry and member count: ``layout_name``, as
    :func:`hf_vkv.devices.choose_layout` decided it (``None``: the cache did not know its device
    then; the rule is asked again with the group's device at its first update)."""

    layout_name: str | None
    block_tokens: int | None
    config: PretrainedConfig
    paged_kernel: str = "exact"

    def __call__(self, geometry: GroupGeometry, members: int) -> Layout:
        name = self.layout_name or devices.choose_layout("contiguous", devices.Workload(device_type=geometry.device.type))
        if name == "static":
            return StaticLayout(geometry, members=members, base=layout_class(policy_for(geometry.device).layout))
        if name == "paged":
            fused = self.paged_kernel == "fused"
            if fused and getattr(self.config, "kv_lora_rank", None) is not None:
                raise CacheOptionError(
                    f"cache_config['paged_kernel']='fused' reads K/V in place, but {self.config.model_type}'s "
                    "attention expands the latents it caches into keys and values after the cache update, which "
                    "the fused kernel cannot see: leave 'paged_kernel' unset (the paged layout then returns the "
                    "gathered tokens, exactly as DynamicCache)")
            config = self.config
            return PagedLayout(geometry, members=members, block_tokens=self.block_tokens or devices.PAGED_BLOCK_TOKENS,
                               fused=fused, attention_of=lambda: getattr(config, "_attn_implementation", None))
        kind = layout_class(name)
        if kind is TokenMajorLayout:
            return TokenMajorLayout(geometry, members=members, copy_reads=reads_need_contiguous(self.config, geometry))
        if kind is HeadMajorLayout:
            return HeadMajorLayout(geometry, members=members, copy_reads=views_misaligned(self.config, geometry))
        return kind(geometry, members=members)


@dataclass(slots=True)
class ArenaSource:
    """One arena per (device, page size), made on first use (``page_bytes``: the option, else the
    layout's preferred size on the device's backend)."""

    page_bytes: int | None
    budget_bytes: int | None
    arenas: dict[tuple[torch.device, int | None], Arena] = field(default_factory=dict)
    #: Asked for pages when a step of a cache drawing from these arenas finds their budget full
    #: (a prefix store lets its least recently used entries go): called with the pages the step
    #: needs and the arena's pool, after the step rolled back; returns whether it let any go.
    reclaim: Callable[[int, PagePool], bool] | None = None

    def __call__(self, device: torch.device, layout: Layout) -> Arena:
        device = torch.device(device)
        page = self.page_bytes or layout.preferred_page_bytes(policy_for(device).backend)
        arena = self.arenas.get((device, page))
        if arena is None or arena.closed:
            arena = arena_for_device(device, page_bytes=page, budget_bytes=self.budget_bytes)
            self.arenas[(device, page)] = arena
        return arena
