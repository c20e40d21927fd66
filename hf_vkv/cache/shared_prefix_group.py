"""The layer group of a model whose attention is ``"vkv_cascade"``: it tags shared prefixes.

Chosen once, when :class:`~hf_vkv.VKVCache` is built: a full-attention group of a contiguous layout
(head-major, token-major) of a model whose attention is ``"vkv_cascade"`` is a
:class:`SharedPrefixGroup`; every other group is a plain :class:`~hf_vkv.cache.group.LayerGroup`
and pays nothing for the feature. (A model switched to ``"vkv_cascade"`` after its cache was built
reads that cache with sdpa's path: exact, not faster.)

At each one-token decode step the group derives from its page tables which rows hold their first
tokens on the same pages (rows ``generate`` expanded from one prompt, beams after every reorder,
forks) and tags the keys each member returns with that :class:`~hf_vkv.kv_records.SharedPrefix`,
so the attention reads each prefix once for all of a cluster's queries. In half precision it tags
nothing unless ``cache_config['cascade_half_precision']`` asks for it, and :attr:`cascade` says why.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import devices
from ..kv_records import Cluster, SharedPrefix, tag_key
from .group import LayerGroup

__all__ = ["SharedPrefixGroup"]


class SharedPrefixGroup(LayerGroup):
    """A :class:`LayerGroup` whose decode steps tag shared prefixes (see the module docstring).

    ``half_precision``: tag in bfloat16 / float16 too (``cache_config['cascade_half_precision']``).
    """

    def __init__(self, *, half_precision: bool, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.half_precision = half_precision
        self._derived: tuple[int, SharedPrefix | None] | None = None  # (the version it was derived at, it)
        self.prefix_refusal: str | None = None  # why the last shared_prefix() left every cluster to sdpa

    @property
    def cascade(self) -> str:
        """What :meth:`VKVCache.stats` reports: ``"on"``; why the cascade takes sdpa's path (half
        precision, the last step's clusters share too few tokens to pay: see
        :func:`hf_vkv.devices.cascade_refusal`, or no attention read the last step's tags); or
        ``"not asked"`` before the first states."""
        if self.geometry is None:
            return "not asked"
        if not self._tags_dtype():
            return (f"sdpa: the cascade can change tokens in {str(self.geometry.dtype).removeprefix('torch.')} "
                    f"(float32 sums rounded once still differ from sdpa's); "
                    f"cache_config={{'cascade_half_precision': True}} asks for it")
        if self.prefix_refusal or self._derived is None:  # why the last step's clusters were refused; no step yet
            return self.prefix_refusal or "on"
        tagged = self._derived[1]
        if tagged is None:
            return "sdpa: no rows of the last step hold their first tokens on the same pages"
        if not tagged.was_read:
            return ("sdpa: the last step's shared prefixes were tagged, but no layer's attention read them once: "
                    "the model's attention gets other keys than the cache returned (it rebuilds them, as multi-head "
                    "latent attention does) or took sdpa's path (a mask that differs over the prefix)")
        return "on"

    def _tags_dtype(self) -> bool:
        """Whether the states' dtype may be tagged (float32, or half precision asked for by name)."""
        return self.half_precision or self.geometry is None or \
            self.geometry.dtype not in (torch.bfloat16, torch.float16)

    def _returned_keys(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        if end - start != 1 or not self._tags_dtype():
            return keys
        prefix = self.shared_prefix()
        return keys if prefix is None else tag_key(keys, prefix)

    def shared_prefix(self) -> SharedPrefix | None:
        """The clusters of rows that hold their first tokens on the same pages (each worth reading
        once: :func:`hf_vkv.devices.cascade_refusal`), derived from the page tables once per step
        (after every reorder: beams share the prompt and whatever full pages of history they still
        have in common); ``None`` when no cluster is worth reading once. :attr:`prefix_refusal`
        keeps why, when a cluster of this step was refused and none kept (else ``None``)."""
        if self._derived is not None and self._derived[0] == self.version:
            return self._derived[1]
        buffer = self._buf()
        rows_of: dict[int, list[int]] = {}  # a cluster's first row -> its rows
        tokens_of: dict[int, int] = {}  # a cluster's first row -> tokens all its rows share
        for row in range(self.batch):
            for first in rows_of:
                shared = buffer.shared_items(row, first)
                if shared:
                    rows_of[first].append(row)
                    tokens_of[first] = min(tokens_of[first], shared)
                    break
            else:
                rows_of[row], tokens_of[row] = [row], buffer.length(row)
        refusals = {first: devices.cascade_refusal(shared_tokens=tokens_of[first], rows=len(rows))
                    for first, rows in rows_of.items() if len(rows) > 1}
        kept = tuple(Cluster(index=tuple(rows_of[first]), tokens=tokens_of[first])
                     for first, refusal in refusals.items() if refusal is None)
        self.prefix_refusal = None if kept else next((r for r in refusals.values() if r is not None), None)
        taken = {r for c in kept for r in c.index}
        prefix = SharedPrefix(clusters=kept, alone=tuple(r for r in range(self.batch) if r not in taken)) \
            if kept else None
        self._derived = (self.version, prefix)
        return prefix

    def _twin_options(self) -> dict[str, Any]:
        return {"half_precision": self.half_precision}
