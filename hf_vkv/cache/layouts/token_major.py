"""Token-major: one token of every member together, ``[tokens, members, (K | V)]`` in a row.

Row ``r``, token ``t`` of the group's :class:`~hf_vkv.memory.VirtualBuffer` holds, for each
member ``l``, its keys ``[H, Dk]`` then its values ``[H, Dv]``. A row strands at most one
partly filled page, so huge pages cost nothing (the GPU default: 2 MiB granularity), and a
member's keys are the strided view ``[B, T, H, Dk] -> transpose(1, 2)`` that every attention
reads without a copy. Consecutive tokens of one head sit a whole token of the group apart, which
costs CPU attention its prefetching at long contexts (see ``docs/layouts.md``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ... import devices
from ...memory import Arena, RowBuffer, VirtualBuffer
from ..geometry import GroupGeometry
from .base import Layout

__all__ = ["TokenMajorLayout"]


class TokenMajorLayout(Layout):
    """See the module docstring."""

    name = "token_major"

    def __init__(self, geometry: GroupGeometry, *, members: int, copy_reads: bool = False) -> None:
        super().__init__(geometry, members=members)
        self.copy_reads = copy_reads  # hand attention contiguous copies (see attention_inputs)

    @classmethod
    def page_bytes(cls, backend: str) -> int | None:
        return devices.TOKEN_MAJOR_PAGE_BYTES if backend == "host" else None

    @property
    def item_bytes(self) -> int:
        """Bytes of one token of the whole group."""
        return self.members * self.geometry.token_elements * self.geometry.dtype.itemsize

    def make_buffer(self, arena: Arena, *, rows: int, capacity: int, readable: bool = False) -> RowBuffer:
        return VirtualBuffer(arena, rows=rows, capacity=capacity, item_bytes=self.item_bytes, readable=readable)

    def full_states(self, buffer: RowBuffer, *, batch: int, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, H, capacity, Dk]`` / ``[..., Dv]`` views of every token position, at fixed addresses
        (a readable buffer only)."""
        assert isinstance(buffer, VirtualBuffer)
        g = self.geometry
        typed = buffer.full_view(g.dtype)[:batch, :buffer.capacity * self.members * g.token_elements]
        tokens = typed.view(batch, buffer.capacity, self.members, g.token_elements)
        keys, values = self._split(tokens[:, :, member])
        return keys.transpose(1, 2), values.transpose(1, 2)

    def _tokens(self, buffer: RowBuffer, batch: int, start: int, end: int) -> torch.Tensor:
        """Typed view ``[batch, end - start, members, H * (Dk + Dv)]`` of tokens ``[start, end)``."""
        key = (batch, start, end)
        typed = self._views.get(key)
        if typed is None:
            assert isinstance(buffer, VirtualBuffer)
            g = self.geometry
            raw = buffer.view(range(batch), start, end)  # uint8 [batch, (end - start) * item_bytes]
            typed = raw.view(g.dtype).view(batch, end - start, self.members, g.token_elements)
            self._views[key] = typed
        return typed

    def _split(self, block: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, T, H * (Dk + Dv)]`` -> ``[B, T, H, Dk]`` keys and ``[B, T, H, Dv]`` values."""
        g = self.geometry
        split = g.kv_heads * g.key_dim
        return block[..., :split].unflatten(-1, (g.kv_heads, g.key_dim)), \
            block[..., split:].unflatten(-1, (g.kv_heads, g.value_dim))

    def write(self, buffer: RowBuffer, *, batch: int, member: int, start: int, key: torch.Tensor,
              value: torch.Tensor, rows: Sequence[int] | None) -> None:
        keys, values = self._split(self._tokens(buffer, batch, start, start + key.shape[2])[:, :, member])
        if rows is None:
            keys.copy_(key.transpose(1, 2))
            values.copy_(value.transpose(1, 2))
            return
        for row in rows:
            keys[row].copy_(key[row].transpose(0, 1))
            values[row].copy_(value[row].transpose(0, 1))

    def cached(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self._split(self._tokens(buffer, batch, start, end)[:, :, member])
        return keys.transpose(1, 2), values.transpose(1, 2)

    def attention_inputs(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int,
                         key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached tokens ``[start, end)``: zero-copy views for a decode step (one new token),
        contiguous copies for several new tokens (a prefill, a chunk: ``DynamicCache`` returns a
        ``torch.cat`` there too) and at every step with ``copy_reads``.

        Why: attention that multiplies the returned tensors directly with a matmul (eager, with one
        key/value head per query head; grouped heads are copied by ``repeat_kv`` first) takes
        another BLAS path over this layout's token-strided keys than over contiguous ones, and its
        logits come out ~1e-6 apart: for several queries at once always, for one query once the
        context is longer than a few dozen tokens; SDPA too where a head's token is not a multiple
        of 64 bytes. The cache sets ``copy_reads`` where that can happen
        (:func:`hf_vkv.cache.sources.reads_need_contiguous`: on the host, every attention but SDPA
        over aligned views and vkv's own)."""
        keys, values = self._split(self._tokens(buffer, batch, start, end)[:, :, member])  # as cached (one call less)
        keys, values = keys.transpose(1, 2), values.transpose(1, 2)
        if self.copy_reads or key.shape[2] > 1:
            return keys.contiguous(), values.contiguous()
        return keys, values
