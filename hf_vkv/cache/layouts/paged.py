"""Paged: rows are block tables into a pool of blocks that stay where they are.

The group's rows are :class:`~hf_vkv.memory.BlockBuffer` rows over a
:class:`~hf_vkv.memory.BlockStore`: a block is ``block_tokens`` tokens of the whole group, laid
out token-major (``[block_tokens, members, H * (Dk + Dv)]``). Sharing, reorders, copy-on-write,
forks, crops and windows are the same page-table operations as in the contiguous layouts, with no
remapping at all. ``update`` returns the layer's tokens gathered through the block tables (what
``DynamicCache`` returns), or, for the fused kernel (``cache_config={"paged_kernel": "fused"}``),
the new states with a :class:`~hf_vkv.kv_records.PagedKV` tag, through which the ``"vkv_paged"``
attention reads the cached tokens in place.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ... import devices
from ...kv_records import PAGED_ATTENTION, PagedKV, tag_key
from ...memory import Arena, BlockBuffer, BlockStore, RowBuffer
from ...memory.errors import ArgumentError, CacheOptionError
from ..geometry import GroupGeometry
from .base import Layout

__all__ = ["PagedLayout"]


class PagedLayout(Layout):
    """See the module docstring."""

    name = "paged"
    draws_from_arena = False

    def __init__(self, geometry: GroupGeometry, *, members: int, block_tokens: int = devices.PAGED_BLOCK_TOKENS,
                 fused: bool = False, attention_of: Callable[[], str | None] | None = None) -> None:
        super().__init__(geometry, members=members)
        if block_tokens <= 0:
            raise CacheOptionError(f"block_tokens must be positive, got {block_tokens} (cache_config['block_tokens'])")
        self.block_tokens = block_tokens
        self.fused = fused  # cache_config["paged_kernel"] == "fused": PagedKV.fused
        # the model's attention now (its config's): the fused layer's new states are read by "vkv_paged" alone
        self._attention_of = attention_of
        self._tables: torch.Tensor | None = None  # block tables of the active rows, until invalidate()
        self._blocks: torch.Tensor | None = None  # typed [N, block_tokens, members, H * (Dk + Dv)]
        self._token_indices: dict[tuple[int, int], torch.Tensor] = {}  # (start, q) -> flat token indices, all rows
        self._handed: PagedKV | None = None  # the fused kernel's last record, until an attention call reads it

    @classmethod
    def page_bytes(cls, backend: str) -> int | None:
        return None

    @property
    def item_bytes(self) -> int:
        return self.members * self.geometry.token_elements * self.geometry.dtype.itemsize

    def make_buffer(self, arena: Arena, *, rows: int, capacity: int, readable: bool = False) -> RowBuffer:
        if readable:
            raise ArgumentError("the paged layout has no full-capacity view: the static layout builds on a "
                                "contiguous one")
        blocks_per_row = -(-capacity // self.block_tokens)
        # Address space only: room for every row at full length four times over (forks, beams).
        store = BlockStore(arena, block_bytes=self.block_tokens * self.item_bytes, max_blocks=4 * rows * blocks_per_row)
        return BlockBuffer(store, rows=rows, capacity=capacity, item_bytes=self.item_bytes)

    def _typed_blocks(self, buffer: RowBuffer) -> torch.Tensor:
        if self._blocks is None:
            assert isinstance(buffer, BlockBuffer)
            raw = buffer.store.blocks()  # uint8 [N, block bytes]
            self._blocks = raw.view(self.geometry.dtype).view(raw.shape[0], self.block_tokens, self.members,
                                                              self.geometry.token_elements)
        return self._blocks

    def block_tables(self, buffer: RowBuffer, batch: int) -> torch.Tensor:
        """int32 ``[batch, max_blocks]`` block tables of the active rows, on the store's device."""
        if self._tables is None:
            assert isinstance(buffer, BlockBuffer)
            self._tables = buffer.block_tables(range(batch)).to(self._typed_blocks(buffer).device)
        return self._tables

    def _member(self, buffer: RowBuffer, member: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[N, block_tokens, H, Dk]`` key and ``[..., Dv]`` value caches of member ``member``."""
        g = self.geometry
        block = self._typed_blocks(buffer)[:, :, member]
        split = g.kv_heads * g.key_dim
        return block[..., :split].unflatten(-1, (g.kv_heads, g.key_dim)), \
            block[..., split:].unflatten(-1, (g.kv_heads, g.value_dim))

    def paged_kv(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int) -> PagedKV:
        """The record the ``"vkv_paged"`` attention reads for tokens ``[start, end)``."""
        keys, values = self._member(buffer, member)
        return PagedKV(keys, values, self.block_tables(buffer, batch), start, end - start, fused=self.fused)

    def write(self, buffer: RowBuffer, *, batch: int, member: int, start: int, key: torch.Tensor,
              value: torch.Tensor, rows: Sequence[int] | None) -> None:
        if self.fused and self._attention_of is not None and self._attention_of() != PAGED_ATTENTION:
            # another attention would take the new states this layer returns for the whole cache
            raise CacheOptionError(
                f"a cache with cache_config['paged_kernel']='fused' is read by the 'vkv_paged' attention only, but "
                f"the model now uses {self._attention_of()!r}: switch it back (model.set_attn_implementation("
                f"'vkv_paged')) or use another cache (without 'paged_kernel', the paged layout returns every "
                f"cached token, as DynamicCache)")
        b, h, q, _ = key.shape
        picked = range(b) if rows is None else rows
        if not picked:
            return
        keys, values = self._member(buffer, member)
        if rows is not None:
            key, value = key[list(rows)], value[list(rows)]
        index = self._token_index(buffer, batch, start, q, rows)
        keys.flatten(0, 1).index_copy_(0, index, key.transpose(1, 2).reshape(-1, h, key.shape[3]))
        values.flatten(0, 1).index_copy_(0, index, value.transpose(1, 2).reshape(-1, h, value.shape[3]))

    def _token_index(self, buffer: RowBuffer, batch: int, start: int, q: int, rows: Sequence[int] | None
                     ) -> torch.Tensor:
        """Flat token indices ``[R * q]`` into the ``[N * block_tokens]`` token axis (block *
        block_tokens + offset in the block) of tokens ``[start, start + q)`` of ``rows`` (``None``:
        all; then kept for the other members' writes of this step)."""
        key = (start, q)
        if rows is None and key in self._token_indices:
            return self._token_indices[key]
        bs = self.block_tokens
        tables = self.block_tables(buffer, batch).long()
        if rows is not None:
            tables = tables[list(rows)]
        tokens = torch.arange(start, start + q, device=tables.device)
        index = (tables[:, tokens // bs] * bs + tokens % bs).reshape(-1)
        if rows is None:
            self._token_indices[key] = index
        return index

    def cached(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies gathered through the block tables: one ``index_select`` of token rows per tensor."""
        q = end - start
        index = self._token_index(buffer, batch, start, q, None)
        out = []
        for cache in self._member(buffer, member):  # [N, block_tokens, H, D]
            rows = cache.flatten(0, 1).index_select(0, index)  # [batch * q, H, D]
            out.append(rows.view(batch, q, *rows.shape[1:]).transpose(1, 2).contiguous())
        return out[0], out[1]

    def attention_inputs(self, buffer: RowBuffer, *, batch: int, member: int, start: int, end: int,
                         key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``DynamicCache`` returns: tokens ``[start, end)`` gathered through the block tables
        (:meth:`cached`), so that a model that reworks its keys or values after the update (values
        split, latents expanded into keys, a position bias sized by the keys) computes on all of
        them, as it would on ``DynamicCache``'s. Only for the fused kernel (``fused``), which reads
        the blocks in place: the new states, both tagged with the :class:`PagedKV` of tokens
        ``[start, end)`` (the value too, so that the attention can tell a value the model replaced
        after the update)."""
        if not self.fused:
            return self.cached(buffer, batch=batch, member=member, start=start, end=end)
        record = self.paged_kv(buffer, batch=batch, member=member, start=start, end=end)
        self._handed = record
        return record.tag(key), tag_key(value, record)

    def check_read(self) -> None:
        """The fused kernel's last record reached an attention call (its receipt), else refuse:
        the model replaced both the key and the value after the update (no tag left for the
        attention to refuse the call by), so the attention read its new states alone where it
        should have read every cached token. The group checks at each update, before it changes
        anything (the next member's update: in the same forward for any layer but a group's last),
        and ``generate`` when its loop returns (:meth:`~hf_vkv.VKVCache.check_reads`)."""
        handed, self._handed = self._handed, None
        if handed is not None and not handed.receipt.read:
            raise CacheOptionError(
                "cache_config['paged_kernel']='fused' cannot serve this model: a layer's attention got other keys and "
                "values than the cache update returned (the model replaced both after the update), so it would attend "
                "to the new tokens alone, not to the cached ones (or the cache was updated again with no attention "
                "call between: a fused cache is read by the model's 'vkv_paged' attention calls only). Use the paged "
                "layout without 'paged_kernel' (it returns every cached token, as DynamicCache) or the default "
                "contiguous layout")

    def invalidate(self) -> None:
        super().invalidate()
        self._tables = None
        self._blocks = None
        self._token_indices = {}
