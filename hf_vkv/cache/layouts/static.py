"""Static: a contiguous layout whose whole capacity is addressable, for ``torch.compile``.

``StaticCache`` is what makes ``torch.compile`` and CUDA graphs work in transformers: fixed-shape
``[B, H, max_tokens, D]`` tensors at fixed addresses, written with ``index_copy_``. The static
layout gives the same contract over virtual memory: its row buffer is *readable* (every token position
of the reservation can be read; positions not yet on a real page read as zeros), and attention gets
full-capacity views at fixed addresses. Physical pages are still mapped on demand — ahead of the
writes, outside the compiled step (:meth:`hf_vkv.VKVCache.map_ahead`) — and beam reorders and
copy-on-write remap pages under the unchanged addresses, so a graph captured at step 1 stays valid.

It wraps the device's contiguous layout (head-major on the CPU, token-major on CUDA): the same
element order, the same writes, only the returned views differ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from ... import devices
from ...memory import Arena, RowBuffer
from ...memory.errors import ArgumentError, CacheOptionError
from ..geometry import GroupGeometry
from .base import Layout
from .head_major import HeadMajorLayout
from .token_major import TokenMajorLayout

__all__ = ["StaticLayout"]


class StaticLayout(Layout):
    """A contiguous ``base`` layout over a readable buffer, handing out full-capacity views."""

    name = "static"
    static = True

    def __init__(self, geometry: GroupGeometry, *, members: int, base: type[Layout]) -> None:
        super().__init__(geometry, members=members)
        if base not in (TokenMajorLayout, HeadMajorLayout):
            raise ArgumentError(f"the static layout builds on a contiguous layout, not {base.name!r}")
        self.base = base(geometry, members=members)
        self._full: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}  # (batch, member) -> views
        self._full_of: RowBuffer | None = None  # the buffer those views cover

    @classmethod
    def page_bytes(cls, backend: str) -> int | None:
        """The class cannot say (it depends on the wrapped layout): see :meth:`preferred_page_bytes`."""
        return None

    def preferred_page_bytes(self, backend: str) -> int | None:
        return self.base.preferred_page_bytes(backend)

    @property
    def item_bytes(self) -> int:
        return self.base.item_bytes

    @property
    def row_parts(self) -> int:
        return self.base.row_parts

    def make_buffer(self, arena: Arena, *, rows: int, capacity: int, readable: bool = True) -> RowBuffer:
        """The base layout's buffer, readable. Over head-major, raise
        :class:`~hf_vkv.memory.errors.CacheOptionError` where ``StaticCache``'s (row, head) blocks of
        ``capacity`` tokens would start at other alignments than this layout's page-aligned ones
        (:data:`hf_vkv.devices.VIEW_ALIGNMENT_BYTES`): attention could round differently, and
        full-capacity views at fixed addresses cannot be copies."""
        if isinstance(self.base, HeadMajorLayout):
            g, align = self.geometry, devices.VIEW_ALIGNMENT_BYTES
            step = math.lcm(*(align // math.gcd(dim * g.dtype.itemsize, align) for dim in (g.key_dim, g.value_dim)))
            if capacity % step:
                raise CacheOptionError(
                    f"the static layout starts each (row, head) of keys and values on a page, and StaticCache's "
                    f"start {capacity} tokens apart, which for {g.describe()} is not a multiple of {align} bytes: "
                    f"attention could round differently from StaticCache's; use cache_config={{'max_cache_len': N}} "
                    f"with N a multiple of {step} (this layout is a compiled step's, compile_config, or "
                    f"cache_config['layout']='static')")
        return self.base.make_buffer(arena, rows=rows, capacity=capacity, readable=True)

    def write(self, buffer: RowBuffer, *, batch: int, member: int, start: int, key: torch.Tensor,
              value: torch.Tensor, rows: Sequence[int] | None) -> None:
        self.base.write(buffer, batch=batch, member=member, start=start, key=key, value=value, rows=rows)

    def cached(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        return self.base.cached(buffer, batch=batch, member=member, start=start, end=end)

    def full_states(self, buffer: RowBuffer, *, batch: int, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, H, capacity, D]`` key and value views of member ``member`` at fixed addresses,
        the same tensor objects for the buffer's life (marked static for dynamo)."""
        if buffer is not self._full_of:  # a new buffer (more rows): new addresses
            self._full, self._full_of = {}, buffer
        views = self._full.get((batch, member))
        if views is None:
            views = self.base.full_states(buffer, batch=batch, member=member)  # type: ignore[attr-defined]
            if not torch.compiler.is_compiling():
                for t in views:
                    torch._dynamo.mark_static_address(t)
            self._full[(batch, member)] = views
        return views

    def attention_inputs(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int,
                         key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token position (``StaticLayer``'s contract: the mask covers the capacity)."""
        return self.full_states(buffer, batch=batch, member=member)

    def invalidate(self) -> None:
        super().invalidate()
        self.base.invalidate()
