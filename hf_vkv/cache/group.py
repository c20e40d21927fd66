"""A layer group: layers that grow identically, stored token-major in one virtual buffer.

Row ``r``, token ``t``, member slot ``l`` of a group's buffer holds that layer's key at
``[r, t, l, 0]`` and value at ``[r, t, l, 1]``, each ``[kv_heads, head_dim]``. So one item of the
buffer is one token of every layer of the group (``layers * 2 * heads * head_dim`` elements), a
row strands at most one partly filled page, and a layer's K is the strided view
``buf[:, :T, l, 0]`` → ``[B, T, H, D]`` → ``.transpose(1, 2)`` → ``[B, H, T, D]``, which eager,
sdpa and flash attention read without a copy.

Operations that concern all rows (reorder, batch changes, reset) are *collective*: transformers
calls them once per layer, the group performs them on the first call and checks off the others.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..memory import Arena, BufferStats, RowBuffer, VirtualBuffer
from ..memory.errors import InvariantError

__all__ = ["LayerGroup", "GroupGeometry", "LayerMismatchError"]


class LayerMismatchError(ValueError):
    """A layer's key/value states do not match the other layers of its group."""


@dataclass(frozen=True, slots=True)
class GroupGeometry:
    """What every member of a group shares."""

    kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device

    def describe(self) -> str:
        return f"{self.kv_heads} KV heads of dim {self.head_dim} in {self.dtype} on {self.device}"


class LayerGroup:
    """The layers ``members`` (model layer indices) of one kind, in one row buffer (a
    :class:`VirtualBuffer`; :class:`~hf_vkv.cache.paged.PagedLayerGroup` uses a block buffer).

    ``sliding_window`` is ``None`` for full attention. The buffer is created at the first update
    (rows and dtype come from the states); ``arena_for(device)`` supplies physical memory.
    """

    def __init__(
        self,
        *,
        name: str,
        members: Sequence[int],
        sliding_window: int | None,
        arena_for: Callable[[torch.device], Arena],
        rows_hint: int | None,
        capacity: int,
        prompt_repeats: int,
        share_prompts: bool,
    ) -> None:
        self.name = name
        self.members = tuple(members)
        self.slot = {layer: k for k, layer in enumerate(self.members)}
        self.sliding_window = sliding_window
        self.capacity = capacity
        self.prompt_repeats = prompt_repeats
        self.share_prompts = share_prompts
        self._arena_for = arena_for
        self._rows_hint = rows_hint
        self.geometry: GroupGeometry | None = None
        self.buffer: RowBuffer | None = None
        self.batch = 0  # rows in use (the batch transformers sees)
        self.record_past = False  # keep pages behind a window (assisted decoding may crop back)
        self.shared_prompt_rows = 0  # rows that took their prompt from another row's pages
        self._epoch = 0  # bumps whenever rows change outside a write
        self._prepared: tuple[int, int, int] | None = None  # (start, end, epoch) made writable
        self._views: dict[tuple[int, int], torch.Tensor] = {}  # typed views valid in this epoch
        self._followers: dict[int, int] = {}  # prefill only: row -> leader row it shares pages with
        self._pending: dict[str, set[int]] = {}
        self._layers: dict[int, Any] = {}  # member index -> its layer object (for lengths)

    def register(self, layer: Any) -> None:
        """Attach a member's layer object (it reports its length through ``get_seq_length``)."""
        self._layers[layer.layer_idx] = layer

    # ----------------------------------------------------------------------------- set-up
    def init_layer(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check a member's first states against the group (and create the buffer on the first)."""
        if key_states.dim() != 4 or key_states.shape != value_states.shape:
            raise LayerMismatchError(
                f"layer {layer}: key/value states must both be [batch, kv_heads, tokens, head_dim], got "
                f"{tuple(key_states.shape)} and {tuple(value_states.shape)}"
            )
        if key_states.dtype != value_states.dtype or key_states.device != value_states.device:
            raise LayerMismatchError(f"layer {layer}: keys and values differ in dtype or device")
        geometry = GroupGeometry(key_states.shape[1], key_states.shape[3], key_states.dtype, key_states.device)
        if self.geometry is None:
            self.geometry = geometry
        elif geometry != self.geometry:
            raise LayerMismatchError(
                f"layer {layer} has {geometry.describe()} but its group {self.name!r} holds "
                f"{self.geometry.describe()}; give each layer its own buffer with "
                f"cache_config={{'group_policy': 'layer'}}"
            )
        if self.buffer is None:
            g = self.geometry
            item = len(self.members) * 2 * g.kv_heads * g.head_dim * g.dtype.itemsize
            rows = max(self._rows_hint or 0, key_states.shape[0])
            self.buffer = self._new_buffer(rows=rows, item_bytes=item)

    def _new_buffer(self, *, rows: int, item_bytes: int) -> RowBuffer:
        assert self.geometry is not None
        return VirtualBuffer(self._arena_for(self.geometry.device), rows=rows, capacity=self.capacity,
                             item_bytes=item_bytes)

    def _buf(self) -> RowBuffer:
        if self.buffer is None:
            raise InvariantError(f"group {self.name!r} used before its first update")
        return self.buffer

    # ----------------------------------------------------------------------------- per step
    def window_start(self, length: int) -> int:
        """First token an update at ``length`` cached tokens returns (mask offset)."""
        if self.sliding_window is None:
            return 0
        return max(length - self.sliding_window + 1, 0)

    def prepare(self, batch: int, start: int, end: int) -> None:
        """Make tokens ``[start, end)`` of rows ``0..batch-1`` writable (once per step for the
        whole group): drop pages behind the window, grow, copy-on-write shared pages, and at a
        prefill of expanded prompts share each prompt's pages across its rows."""
        buffer = self._buf()
        if self._prepared == (start, end, self._epoch) and batch == self.batch:
            return
        if batch > buffer.rows and not any(buffer.length(r) for r in range(buffer.rows)):
            # an empty cache (new, or after reset()) takes a larger batch, as a DynamicCache does
            buffer = self._more_rows(batch)
        if batch > buffer.rows:
            raise LayerMismatchError(
                f"batch {batch} is larger than the {buffer.rows} rows the cache was created for; "
                f"create a new cache (or let generate() size it)"
            )
        rows = range(batch)
        self._settle_followers()
        if self.sliding_window is not None and not self.record_past:
            buffer.drop_before(rows, self.window_start(start))
        k = self.prompt_repeats
        if start == 0 and end > 0 and self.share_prompts and k > 1 and batch % k == 0:
            leaders = range(0, batch, k)
            buffer.truncate(rows, 0)
            buffer.prepare_write(leaders, 0, end)
            for leader in leaders:
                buffer.share(leader, range(leader + 1, leader + k), length=end)
                self._followers.update({r: leader for r in range(leader + 1, leader + k)})
        else:
            buffer.prepare_write(rows, start, end)
        self.batch = batch
        self._new_epoch()
        self._prepared = (start, end, self._epoch)

    def view(self, start: int, end: int) -> torch.Tensor:
        """Tokens ``[start, end)`` of the active rows, typed: ``[B, T, layers, 2, H, D]``."""
        typed = self._views.get((start, end))
        if typed is None:
            g = self.geometry
            buffer = self._buf()
            assert g is not None and isinstance(buffer, VirtualBuffer)
            raw = buffer.view(range(self.batch), start, end)
            typed = raw.view(g.dtype).view(self.batch, end - start, len(self.members), 2, g.kv_heads, g.head_dim)
            self._views[(start, end)] = typed
        return typed

    def write(self, layer: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Store ``[B, H, q, D]`` states of ``layer`` at tokens ``[start, start + q)``."""
        rows = None  # all of them
        if self._followers:
            rows = [r for r in range(self.batch) if not self._follows_leader(r, start, key_states, value_states)]
        self._store(self.slot[layer], start, key_states, value_states, rows)

    def _follows_leader(self, row: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
        """Whether ``row`` still shares its prompt's pages with its leader: its states equal the
        leader's. If not, the row gets its own pages (copies of the leader's, right for the layers
        written so far, which all compared equal) and is written on its own from now on."""
        leader = self._followers.get(row)
        if leader is None:
            return False
        if torch.equal(key_states[row], key_states[leader]) and torch.equal(value_states[row], value_states[leader]):
            return True
        del self._followers[row]
        end = start + key_states.shape[2]
        self._buf().prepare_write([row], start, end)
        self._new_epoch()
        self._prepared = (start, end, self._epoch)
        return False

    def _store(self, slot: int, start: int, key_states: torch.Tensor, value_states: torch.Tensor,
               rows: list[int] | None) -> None:
        """Write ``[B, H, q, D]`` states into member ``slot`` at tokens ``[start, start + q)`` of
        ``rows`` (``None``: every row)."""
        store = self.view(start, start + key_states.shape[2])[:, :, slot]  # [B, q, 2, H, D]
        if rows is None:
            store[:, :, 0].copy_(key_states.transpose(1, 2))
            store[:, :, 1].copy_(value_states.transpose(1, 2))
            return
        for row in rows:
            store[row, :, 0].copy_(key_states[row].transpose(0, 1))
            store[row, :, 1].copy_(value_states[row].transpose(0, 1))

    def states(self, layer: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy ``[B, H, T, D]`` key and value views of ``layer`` over tokens ``[start, end)``."""
        block = self.view(start, end)[:, :, self.slot[layer]]  # [B, T, 2, H, D]
        return block[:, :, 0].transpose(1, 2), block[:, :, 1].transpose(1, 2)

    def attention_inputs(self, layer: int, start: int, end: int, key_states: torch.Tensor,
                         value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns to attention after writing ``key_states``/``value_states``:
        here the ``[B, H, end - start, D]`` views of tokens ``[start, end)``."""
        return self.states(layer, start, end)

    # ----------------------------------------------------------------------------- collective ops
    def collective(self, op: str, layer: int, action: Callable[[], None]) -> None:
        """Run ``action`` on the first member's call of ``op``; check off the other members'."""
        pending = self._pending.get(op)
        if pending:
            if layer not in pending:
                raise InvariantError(f"layer {layer} called {op} twice before the rest of group {self.name!r}")
            pending.discard(layer)
            return
        action()
        rest = set(self.members) - {layer}
        if rest:
            self._pending[op] = rest

    def reorder(self, index: Sequence[int]) -> None:
        """Row ``i`` takes row ``index[i]``'s pages (beam search, batch selection): no copy."""
        if self.buffer is None:
            return
        bad = [i for i in index if not 0 <= i < self.batch]
        if bad:
            raise IndexError(f"row indices {bad[:4]} are out of range for a batch of {self.batch}")
        self.buffer.reorder(index)
        self.batch = len(index)
        self._changed()

    def repeat_rows(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times, consecutively (shared pages, no copy)."""
        if self.buffer is None:
            return
        if repeats < 1:
            raise ValueError(f"repeats must be >= 1, got {repeats}")
        index = [r for r in range(self.batch) for _ in range(repeats)]
        if len(index) > self.buffer.rows:
            self._more_rows(len(index))
        self.buffer.reorder(index)
        self.batch = len(index)
        self._changed()

    def _more_rows(self, rows: int) -> RowBuffer:
        """Move to a buffer of ``rows`` rows sharing every page (a remap, no copy)."""
        old = self._buf()
        self.buffer = old.fork(rows=rows)
        old.close()
        return self.buffer

    def truncate_to_members(self) -> None:
        """Drop the tokens past the longest member (after members were cropped)."""
        length = max((layer.get_seq_length() for layer in self._layers.values()), default=0)
        if self.buffer is not None and any(self.buffer.length(r) > length for r in range(self.batch)):
            self.buffer.truncate(range(self.buffer.rows), length)
            self._changed()

    def clear(self) -> None:
        """Empty every row (the buffer and its reservation stay)."""
        if self.buffer is not None:
            self.buffer.clear(range(self.buffer.rows))
            self.batch = 0
            self._changed()

    def _settings(self) -> dict[str, Any]:
        """Constructor arguments (but ``arena_for``) of a group like this one."""
        return dict(name=self.name, members=self.members, sliding_window=self.sliding_window,
                    rows_hint=self._rows_hint, capacity=self.capacity, prompt_repeats=self.prompt_repeats,
                    share_prompts=self.share_prompts)

    def fork(self, arena_for: Callable[[torch.device], Arena]) -> LayerGroup:
        """A copy sharing every page (zero copy); both sides copy a page only when writing it."""
        other = type(self)(arena_for=arena_for, **self._settings())
        other.geometry = self.geometry
        other.batch = self.batch
        other.record_past = self.record_past
        if self.buffer is not None:
            other.buffer = self.buffer.fork()
        return other

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self._changed()  # drop the views kept for this epoch: they cover unmapped memory now

    def stats(self) -> BufferStats | None:
        return None if self.buffer is None or self.buffer.closed else self.buffer.stats()

    @property
    def prompt_sharing_rows(self) -> int:
        """Rows that took their prompt from another row's pages (including a prefill in progress)."""
        return self.shared_prompt_rows + len(self._followers)

    def _settle_followers(self) -> None:
        """The prefill's writes are over: rows still following a leader share its prompt."""
        self.shared_prompt_rows += len(self._followers)
        self._followers = {}

    def _new_epoch(self) -> None:
        self._epoch += 1
        self._views = {}

    def _changed(self) -> None:
        self._settle_followers()
        self._new_epoch()
        self._prepared = None
