"""The layout interface: where a (layer, K/V, head, token) element sits in a group's row pages.

A :class:`~hf_vkv.cache.group.LayerGroup` keeps rows, lengths and row operations; its layout
object decides everything that touches tensors:

* :meth:`Layout.make_buffer` — the row buffer (a translator of :mod:`hf_vkv.memory`) the group's
  page tables live in;
* :meth:`Layout.write` — store a member's new ``[B, H, q, D]`` states at tokens ``[start, end)``;
* :meth:`Layout.attention_inputs` — what the member's ``update`` returns to attention;
* :meth:`Layout.cached` — ``[B, H, T, D]`` key/value tensors of tokens ``[start, end)`` (for
  ``layer.keys`` / ``layer.values`` and the A/B tee);
* :meth:`Layout.page_bytes` — the page size it prefers on a backend (``None``: the backend's).

A layout may keep views for the current rows; :meth:`Layout.invalidate` drops them whenever the
group's rows change (a page may have moved), and views never outlive that.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from ...memory import Arena, RowBuffer
from ..geometry import GroupGeometry

__all__ = ["Layout"]


class Layout(ABC):
    """How one layer group's rows are laid out (see the module docstring).

    ``geometry`` is the shape every member shares; ``members`` the number of layers (member
    indices ``0 .. members-1``: a layer's position in its group).
    """

    #: The name ``cache_config={"layout": ...}`` selects it by.
    name: ClassVar[str]
    #: Whether ``update`` returns fixed-address, full-capacity views (StaticLayer's contract).
    static: ClassVar[bool] = False
    #: Whether a row buffer's pages are its arena's own (a row image can be installed from an
    #: arena's pages); the paged layout's live in a block store inside the arena.
    draws_from_arena: ClassVar[bool] = True

    def __init__(self, geometry: GroupGeometry, *, members: int) -> None:
        self.geometry = geometry
        self.members = members
        self._views: dict[tuple[int, int, int], torch.Tensor] = {}  # (batch, start, end) -> view, until invalidate()

    @classmethod
    @abstractmethod
    def page_bytes(cls, backend: str) -> int | None:
        """The page size this layout prefers on ``backend`` (``"host"`` / ``"cuda"``);
        ``None``: the backend's own (CUDA: the driver's granularity)."""

    def preferred_page_bytes(self, backend: str) -> int | None:
        """:meth:`page_bytes` of this layout object (a wrapping layout asks the one it wraps)."""
        return type(self).page_bytes(backend)

    @property
    @abstractmethod
    def item_bytes(self) -> int:
        """Bytes of one token in one part of a row of the buffers :meth:`make_buffer` makes."""

    @property
    def row_parts(self) -> int:
        """Parts (page tables) of a row of the buffers :meth:`make_buffer` makes."""
        return 1

    @abstractmethod
    def make_buffer(self, arena: Arena, *, rows: int, capacity: int, readable: bool = False) -> RowBuffer:
        """An empty row buffer of ``rows`` rows of up to ``capacity`` tokens in ``arena``;
        ``readable``: every token of the reservation may be read (see
        :meth:`~hf_vkv.memory.VirtualBuffer.full_view`), for the static layout."""

    @abstractmethod
    def write(self, buffer: RowBuffer, *, batch: int, member: int, start: int, key: torch.Tensor,
              value: torch.Tensor, rows: Sequence[int] | None) -> None:
        """Store the ``[batch, H, q, Dk]`` keys / ``[batch, H, q, Dv]`` values of member
        ``member`` (the layer's index in its group) at tokens ``[start, start + q)`` of ``rows``
        (``None``: rows ``0 .. batch-1``). The tokens are writable (the group prepared them)."""

    @abstractmethod
    def cached(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[batch, H, end - start, Dk]`` keys and ``[..., Dv]`` values of member ``member``
        (views where the layout allows, else copies), valid until the rows change."""

    @abstractmethod
    def attention_inputs(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int,
                         key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns after writing ``key``/``value``: the cached tokens ``[start, end)``
        (``kv_length`` of the mask) as attention reads them — views (head-major returns its
        :meth:`cached` views), copies where a view would change
        the arithmetic (token-major), full-capacity views (static), gathered copies (paged) or
        the tagged new states (paged, fused kernel)."""

    def check_read(self) -> None:
        """Raise :class:`~hf_vkv.memory.errors.CacheOptionError` where what :meth:`attention_inputs`
        last returned cannot have reached the attention. Views and copies are what
        ``DynamicCache`` returns: whatever the model does with them, nothing to check (the paged
        layout of the fused kernel checks its record's receipt)."""

    def invalidate(self) -> None:
        """The rows changed: forget views taken of them."""
        self._views = {}
