"""Head-major: each (member, K/V, head) of a row is a sub-row of its own, as in a DynamicCache.

The group's :class:`~hf_vkv.memory.SubRowBuffer` has ``2 * members`` blocks (member ``l``'s keys
are block ``2l``, its values block ``2l + 1``) of ``H`` sub-rows per row, each holding one head's
tokens ``[T, D]`` one after another. A member's keys are then the view ``[B, H, T, Dk]`` with
``stride(T) == D`` and ``stride(B) == H * stride(H)``: the strides of a contiguous tensor but for
the row gap, so attention reads them as it reads a ``DynamicCache``'s (the same BLAS calls, hence
bit-identical logits with eager attention too), while pages are mapped on demand and shared.

The price is page granularity: a row strands up to one partly filled page per sub-row
(``members * 2 * H`` of them), so this layout wants small pages (:data:`hf_vkv.devices.HEAD_MAJOR_PAGE_BYTES`
on the host). With different key and value widths (MLA) a sub-row item is the wider one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import devices
from ...memory import Arena, RowBuffer, SubRowBuffer
from ..geometry import GroupGeometry
from .base import Layout

__all__ = ["HeadMajorLayout"]


class HeadMajorLayout(Layout):
    """See the module docstring."""

    name = "head_major"

    def __init__(self, geometry: GroupGeometry, *, members: int, copy_reads: bool = False) -> None:
        super().__init__(geometry, members=members)
        self.copy_reads = copy_reads  # hand attention contiguous copies (see attention_inputs)

    @classmethod
    def page_bytes(cls, backend: str) -> int | None:
        return devices.HEAD_MAJOR_PAGE_BYTES if backend == "host" else None

    @property
    def item_dim(self) -> int:
        """Elements of one token of one sub-row (the wider of the key and value head dims)."""
        return max(self.geometry.key_dim, self.geometry.value_dim)

    @property
    def item_bytes(self) -> int:
        """Bytes of one token of one sub-row."""
        return self.item_dim * self.geometry.dtype.itemsize

    @property
    def row_parts(self) -> int:
        """Sub-rows of a row: one per (member, K/V, head)."""
        return 2 * self.members * self.geometry.kv_heads

    def make_buffer(self, arena: Arena, *, rows: int, capacity: int, readable: bool = False) -> RowBuffer:
        return SubRowBuffer(arena, rows=rows, blocks=2 * self.members, heads=self.geometry.kv_heads, capacity=capacity,
                            item_bytes=self.item_bytes, readable=readable)

    def full_states(self, buffer: RowBuffer, *, batch: int, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, H, capacity, Dk]`` / ``[..., Dv]`` views of every token position, at fixed addresses
        (a readable buffer only)."""
        assert isinstance(buffer, SubRowBuffer)
        g = self.geometry
        typed = buffer.full_view(g.dtype).view(2 * self.members, buffer.rows, g.kv_heads, -1)
        tokens = typed[:, :batch, :, :buffer.capacity * self.item_dim].unflatten(-1, (buffer.capacity, self.item_dim))
        return self._pick(tokens, member)

    def _tokens(self, buffer: RowBuffer, batch: int, start: int, end: int) -> torch.Tensor:
        """Typed view ``[2 * members, batch, H, end - start, item_dim]`` of tokens ``[start, end)``."""
        key = (batch, start, end)
        typed = self._views.get(key)
        if typed is None:
            assert isinstance(buffer, SubRowBuffer)
            g = self.geometry
            raw = buffer.view(range(batch), start, end)  # uint8 [2 * members, batch, H, (end - start) * item bytes]
            typed = raw.view(g.dtype).unflatten(-1, (end - start, self.item_dim))
            self._views[key] = typed
        return typed

    def _pick(self, tokens: torch.Tensor, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.geometry
        return tokens[2 * member, ..., :g.key_dim], tokens[2 * member + 1, ..., :g.value_dim]

    def write(self, buffer: RowBuffer, *, batch: int, member: int, start: int, key: torch.Tensor,
              value: torch.Tensor, rows: Sequence[int] | None) -> None:
        keys, values = self._pick(self._tokens(buffer, batch, start, start + key.shape[2]), member)
        if rows is None:
            keys.copy_(key)
            values.copy_(value)
            return
        for row in rows:
            keys[row].copy_(key[row])
            values[row].copy_(value[row])

    def cached(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pick(self._tokens(buffer, batch, start, end), member)

    def attention_inputs(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int,
                         key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The views of the cached tokens, as :meth:`cached` (they hold ``key``/``value``, just
        written); contiguous copies with ``copy_reads``: where a head's token is not a multiple of
        :data:`hf_vkv.devices.VIEW_ALIGNMENT_BYTES`, a view's (row, head) blocks start at other
        alignments than DynamicCache's and attention can round differently
        (:func:`hf_vkv.cache.sources.views_misaligned`)."""
        keys, values = self._pick(self._tokens(buffer, batch, start, end), member)
        if self.copy_reads:
            return keys.contiguous(), values.contiguous()
        return keys, values
