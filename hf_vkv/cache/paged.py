"""The paged layout of a layer group: tokens in blocks of a pool, rows as block tables.

Same bookkeeping as the contiguous layout (one page table per group; sharing, beams, forks,
crops and windows are the same operations), but a page is a *block* of ``block_tokens`` tokens
inside a :class:`~hf_vkv.memory.BlockStore` and nothing is ever remapped: the ``"vkv_paged"``
attention (:mod:`hf_vkv.attention.paged`) reads a layer's tokens through the group's block tables.

A block holds ``[block_tokens, layers, 2, kv_heads, head_dim]`` (token-major, like a contiguous
row), so a layer's key cache is the strided view ``blocks[:, :, slot, 0]`` →
``[num_blocks, block_tokens, kv_heads, head_dim]``.

``update`` returns the new states, tagged with a :class:`PagedKV` record (attribute
``_hf_vkv_paged`` of the returned key tensor) that tells the attention which cache layer and
which tokens to read. The tag travels with the tensor the model hands to its attention function,
so it works however the cache reached the model (built by ``generate``, passed as
``past_key_values``, or in a direct ``forward`` call), and an attention function that receives
untagged K/V (a ``DynamicCache``, a contiguous ``VKVCache``) simply computes on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..memory import BlockBuffer, BlockStore, RowBuffer
from .group import LayerGroup

__all__ = ["PagedLayerGroup", "PagedKV", "PAGED_TAG", "DEFAULT_BLOCK_TOKENS"]

#: Attribute of the key tensor ``update`` returns in the paged layout.
PAGED_TAG = "_hf_vkv_paged"
#: Default tokens per block (chosen by ``benchmarks/paged_cpu.py``; see the README).
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True, slots=True)
class PagedKV:
    """What a paged attention reads for one layer after an update: tokens ``[kv_offset,
    kv_offset + kv_len)`` of every row of ``group``'s member ``layer``."""

    group: PagedLayerGroup
    layer: int
    kv_offset: int
    kv_len: int

    def caches(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache, block_tables)``: ``[num_blocks, block_tokens, H, D]`` views
        of the block store (``stride(-1) == 1``) and int32 ``[B, max_blocks]`` tables."""
        return self.group.paged_inputs(self.layer)


class PagedLayerGroup(LayerGroup):
    """A :class:`LayerGroup` whose rows are block tables into a :class:`BlockStore`."""

    def __init__(self, *, block_tokens: int, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if block_tokens <= 0:
            raise ValueError(f"block_tokens must be positive, got {block_tokens}")
        self.block_tokens = block_tokens
        self._tables: torch.Tensor | None = None  # block tables of the active rows, this epoch
        self._blocks: torch.Tensor | None = None  # typed [N, block_tokens, layers, 2, H, D], this epoch
        self._slot_cache: dict[tuple[int, int], torch.Tensor] = {}  # token slots of all rows, this epoch

    def _new_buffer(self, *, rows: int, item_bytes: int) -> RowBuffer:
        assert self.geometry is not None
        blocks_per_row = -(-self.capacity // self.block_tokens)
        # Address space only: room for every row at full length four times over (forks, beams).
        store = BlockStore(self._arena_for(self.geometry.device), block_bytes=self.block_tokens * item_bytes,
                           max_blocks=4 * rows * blocks_per_row)
        return BlockBuffer(store, rows=rows, capacity=self.capacity, item_bytes=item_bytes)

    def _settings(self) -> dict[str, Any]:
        return {**super()._settings(), "block_tokens": self.block_tokens}

    def _blocks_typed(self) -> torch.Tensor:
        if self._blocks is None:
            g = self.geometry
            buffer = self._buf()
            assert g is not None and isinstance(buffer, BlockBuffer)
            raw = buffer.arena.blocks()
            self._blocks = raw.view(g.dtype).view(raw.shape[0], self.block_tokens, len(self.members), 2,
                                                  g.kv_heads, g.head_dim)
        return self._blocks

    def block_tables(self) -> torch.Tensor:
        """int32 ``[B, max_blocks]`` block tables of the active rows (see
        :meth:`~hf_vkv.memory.BlockBuffer.block_tables`)."""
        if self._tables is None:
            buffer = self._buf()
            assert isinstance(buffer, BlockBuffer)
            self._tables = buffer.block_tables(range(self.batch))
        return self._tables

    def paged_inputs(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(key_cache, value_cache, block_tables)`` of member ``layer`` (see :class:`PagedKV`)."""
        blocks = self._blocks_typed()[:, :, self.slot[layer]]  # [N, bs, 2, H, D]
        tables = self.block_tables()
        if tables.device != blocks.device:
            self._tables = tables = tables.to(blocks.device)
        return blocks[:, :, 0], blocks[:, :, 1], tables

    def _store(self, slot: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor,
               rows: list[int] | None) -> None:
        b, h, q, d = key_states.shape
        picked = range(b) if rows is None else rows
        if not picked:
            return
        flat = self._blocks_typed().view(-1, len(self.members), 2, h, d)[:, slot]  # [N * bs, 2, H, D]
        if rows is not None:
            key_states, value_states = key_states[rows], value_states[rows]
        slots = self._slots(start, q, rows, flat.device)
        flat[:, 0].index_copy_(0, slots, key_states.transpose(1, 2).reshape(-1, h, d))
        flat[:, 1].index_copy_(0, slots, value_states.transpose(1, 2).reshape(-1, h, d))

    def _slots(self, start: int, q: int, rows: list[int] | None, device: torch.device) -> torch.Tensor:
        """Flat token slots ``[R * q]`` (block * block_tokens + offset) of tokens ``[start, start + q)``
        of ``rows`` (``None``: all; then kept for the other members' writes of this epoch)."""
        key = (start, q)
        if rows is None and key in self._slot_cache:
            return self._slot_cache[key]
        bs = self.block_tokens
        tables = self.block_tables().to(device=device, dtype=torch.long)
        if rows is not None:
            tables = tables[rows]
        tokens = torch.arange(start, start + q, device=device)
        slots = (tables[:, tokens // bs] * bs + tokens % bs).reshape(-1)
        if rows is None:
            self._slot_cache[key] = slots
        return slots

    def states(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, T, D]`` copies of ``layer``'s keys and values over tokens ``[start, end)``,
        gathered through the block tables."""
        from ..attention.kernels import gather_kv

        key_cache, value_cache, tables = self.paged_inputs(layer)
        return gather_kv(key_cache, value_cache, tables, kv_offset=start, kv_len=end - start)

    def attention_inputs(self, layer: int, start: int, end: int, key_states: torch.Tensor,
                         value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The new states, the key tagged with the :class:`PagedKV` of tokens ``[start, end)``."""
        tagged = key_states.view_as(key_states)  # a new tensor object: the model's own stays untagged
        setattr(tagged, PAGED_TAG, PagedKV(self, layer, start, end - start))
        return tagged, value_states

    def _new_epoch(self) -> None:
        super()._new_epoch()
        self._tables = None
        self._blocks = None
        self._slot_cache = {}
