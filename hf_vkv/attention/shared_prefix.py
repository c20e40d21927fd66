"""What a contiguous cache layer tells the ``"vkv_cascade"`` attention: which rows share a prefix.

Rows that ``generate`` expanded from one prompt, beams with a common history and forks hold their
first tokens on the same physical pages. The cache derives that from its page tables once per
step (:meth:`hf_vkv.cache.group.LayerGroup.shared_prefix`) and tags the keys each full-attention
layer returns with a :class:`SharedPrefix` (:func:`~hf_vkv.attention.paged_kv.tag_key`, the
mechanism the paged layout's record uses); :mod:`hf_vkv.attention.cascade` reads the prefix once
for all of a cluster's queries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

__all__ = ["SharedPrefix", "Cluster"]


@dataclass(frozen=True, slots=True)
class Cluster:
    """Rows ``first .. first + rows - 1`` (consecutive) or ``index`` (any) whose keys/values
    ``[0, tokens)`` are the same bytes (the same pages)."""

    index: tuple[int, ...]
    tokens: int

    @property
    def consecutive(self) -> bool:
        return self.index == tuple(range(self.index[0], self.index[0] + len(self.index)))


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The clusters of rows (each of >= 2 rows) of one step of one layer group that share a
    prefix, and the rows in none (``alone``). Token positions count from the first token the
    layer returns (full attention: token 0)."""

    clusters: tuple[Cluster, ...]
    alone: tuple[int, ...]
    # [mask, its version, whether every cluster's rows have equal mask columns over its prefix]: a
    # forward passes one mask object to all its layers, so it is checked once per forward, not per
    # layer; the tensor's version counter moves on an in-place change, which is checked again
    _checked: list = field(default_factory=list, compare=False, repr=False)

    def mask_agrees(self, mask: torch.Tensor) -> bool:
        """Whether ``mask`` (bool ``[B, 1, q, kv]``) is the same over each cluster's prefix in
        each of its rows (rows of one prompt are padded alike; a caller's mask may differ)."""
        if self._checked and self._checked[0] is mask and self._checked[1] == mask._version:
            return self._checked[2]
        verdict = all(
            torch.equal(mask[list(c.index), ..., :c.tokens], mask[c.index[0]:c.index[0] + 1, ..., :c.tokens]
                        .expand(len(c.index), *mask.shape[1:-1], c.tokens))
            for c in self.clusters)
        self._checked[:] = [mask, mask._version, verdict]
        return verdict
