"""A layer group: layers that grow identically, their rows, lengths and row operations.

A group owns one row buffer (made by its :class:`~hf_vkv.cache.layouts.Layout` at the first
update, when the states' shape, dtype and device are known) and the lengths of its members. Every
row operation (grow, share a prompt, reorder beams, select or repeat rows, crop, window, reset) is
a page-table operation on the buffer; the layout alone touches tensors.

Invariants (checked by :meth:`LayerGroup.check_invariants`):

* every member's length is at most every active row's length in the buffer (a step grows the rows
  once, then each member writes its tokens), and rows past ``batch`` are empty;
* a sliding group holds at least the window its next update returns (``window_start``).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from .. import devices
from ..kv_records import paged_kv_of
from ..memory import Arena, BufferStats, PageId, RowBuffer, VirtualBuffer
from ..memory.errors import ArgumentError, CacheIndexError, InvariantError, VKVError
from .geometry import GroupGeometry, LayerMismatchError
from .layouts import Layout, layout_option
from .oom import pages_for_step
from .prompt_sharing import PromptSharing
from .row_image import GroupImage

__all__ = ["LayerGroup", "LayoutFactory", "WindowRollbackError"]

#: Makes a group's layout from its geometry and member count (``None``: the device's default).
LayoutFactory = Callable[[GroupGeometry, int], Layout]


class WindowRollbackError(VKVError, RuntimeError):
    """A crop of a sliding-window layer that has passed its window without
    ``activate_past_recording()``: the tokens the crop would bring back into the window were dropped
    (transformers' ``DynamicSlidingWindowLayer`` refuses it with a ``RuntimeError`` too)."""


class LayerGroup:
    """The layers ``members`` (model layer indices) of one kind.

    ``sliding_window`` is ``None`` for full attention. ``make_layout`` builds the layout once the
    first states are known; ``arena_for(device, layout)`` supplies physical memory.
    """

    def __init__(
        self,
        *,
        name: str,
        members: Sequence[int],
        sliding_window: int | None,
        make_layout: LayoutFactory,
        arena_for: Callable[[torch.device, Layout], Arena],
        rows_hint: int | None,
        capacity: int,
        prompt_repeats: int,
        share_prompts: bool,
    ) -> None:
        self.name = name
        self.members = tuple(members)
        self.member_of = {layer: k for k, layer in enumerate(self.members)}  # layer -> its member index
        self.sliding_window = sliding_window
        self.capacity = capacity
        self.prompts = PromptSharing(repeats=prompt_repeats, enabled=share_prompts)
        self._make_layout = make_layout
        self._arena_for = arena_for
        self._rows_hint = rows_hint
        self.geometry: GroupGeometry | None = None
        self.layout: Layout | None = None
        self.buffer: RowBuffer | None = None
        self.batch = 0  # rows in use (the batch transformers sees)
        self.lengths = [0] * len(self.members)  # tokens each member has cached
        self.record_past = False  # keep pages behind a window (assisted decoding may crop back)
        self._kept_from: int | None = None  # while recording: first token `keys` shows (as DynamicSlidingWindowLayer)
        self.written_from = 0  # tokens before it were never written (a window restored by write_states)
        self._prepared: tuple[int, int, int] | None = None  # (batch, start, end) made writable since the last change
        self.version = 0  # moves whenever a step is prepared or the rows change (what a step derives is keyed by it)

    # ----------------------------------------------------------------------------- set-up
    def init_layer(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Check a member's first states against the group (and make the layout and buffer on the first)."""
        geometry = GroupGeometry.of(layer, key_states, value_states)
        if self.geometry is None:
            self.geometry = geometry
        elif geometry != self.geometry:
            raise LayerMismatchError(
                f"layer {layer} has {geometry.describe()} but its group {self.name!r} holds "
                f"{self.geometry.describe()}; give each layer its own group with cache_config={{'groups': 'layer'}}"
            )
        if self.buffer is None:
            self._first_buffer(self.geometry, rows=key_states.shape[0], tokens=key_states.shape[2])

    def _first_buffer(self, geometry: GroupGeometry, *, rows: int, tokens: int, fit: bool = False) -> None:
        """The group's layout and buffer for its first states (an update, rows taken from other
        groups, a row image): at least ``rows`` rows (the hint's, if more), each reserving
        :attr:`capacity` within the arena's budget (:meth:`_within_budget`; ``fit``: never fewer
        than ``tokens``, which an image already holds)."""
        self.geometry = geometry
        self.layout = self._make_layout(geometry, len(self.members))
        arena = self._arena_for(geometry.device, self.layout)
        self.capacity = self._within_budget(arena.budget_bytes, tokens)
        if fit:
            self.capacity = max(self.capacity, tokens)
        self.buffer = self.layout.make_buffer(arena, rows=max(self._rows_hint or 0, rows), capacity=self.capacity)

    def _within_budget(self, budget_bytes: int | None, tokens: int, geometry: GroupGeometry | None = None) -> int:
        """Tokens to reserve per row: :attr:`capacity`, but never more than one row could hold within
        the arena's budget (its pages are all distinct), nor fewer than the first ``tokens``. A
        ``generate(max_new_tokens=10**12, max_time=...)`` asks for an address range no system can
        reserve; the budget runs out first (:class:`KVCacheOutOfMemory`), as a DynamicCache's memory would.
        A sliding group drops its pages behind the window, so the budget does not bound its tokens:
        it reserves within :data:`~hf_vkv.devices.SLIDING_ROW_ADDRESS_BYTES` a row, or the budget
        where that is larger. ``geometry``: the states' (default: this group's)."""
        geometry = geometry or self.geometry
        if budget_bytes is None or geometry is None:
            return self.capacity
        per_token = len(self.members) * geometry.token_elements * geometry.dtype.itemsize
        if self.sliding_window is not None:
            budget_bytes = max(budget_bytes, devices.SLIDING_ROW_ADDRESS_BYTES)
        # one token more than the budget holds: the pool refuses it first, with the typed error
        return min(self.capacity, max(budget_bytes // per_token + 1, tokens))

    def _buf(self) -> RowBuffer:
        if self.buffer is None:
            raise InvariantError(f"group {self.name!r} used before its first update")
        return self.buffer

    def _lay(self) -> Layout:
        if self.layout is None:
            raise InvariantError(f"group {self.name!r} used before its first update")
        return self.layout

    # ----------------------------------------------------------------------------- lengths
    def length(self, layer: int) -> int:
        """Tokens member ``layer`` has cached."""
        return self.lengths[self.member_of[layer]]

    def window_start(self, length: int) -> int:
        """First token an update at ``length`` cached tokens returns (the mask's ``kv_offset``)."""
        if self.sliding_window is None:
            return 0
        return max(length - self.sliding_window + 1, 0)

    def kept_from(self, layer: int) -> int:
        """First token ``layer.keys`` shows: the window, or every token recorded since the last crop."""
        if self._kept_from is not None:
            return self._kept_from
        return self.window_start(self.length(layer))

    # ----------------------------------------------------------------------------- per step
    def update(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, *, plain: bool = False
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store member ``layer``'s new ``[B, H, q, D]`` states after its cached tokens and return
        what attention reads: ``[B, H, kv_length, D]`` (``kv_length`` as the mask's) or, in the
        paged layout of the fused kernel, the tagged new states (``plain``: there too the
        ``[B, H, kv_length, D]`` tokens, gathered through the block tables: the gradient path's
        ``torch.cat`` reads them)."""
        self.geometry.check(layer, key_states, value_states)
        if self.layout is not None:
            self.layout.check_read()  # the last update's record reached an attention call
        member = self.member_of[layer]
        start = self.lengths[member]
        end = start + key_states.shape[2]
        self.prepare(key_states.shape[0], start, end)
        rows = None
        if self.prompts.following:
            leavers = self.prompts.leavers(key_states, value_states)
            if leavers:  # pages of their own (copies of the leader's, right for the layers written so far)
                self._buf().prepare_write(leavers, start, end)
                self._lay().invalidate()
            rows = self.prompts.writes(self.batch)
        layout, buffer = self._lay(), self._buf()
        layout.write(buffer, batch=self.batch, member=member, start=start, key=key_states, value=value_states, rows=rows)
        self.lengths[member] = end
        keys, values = layout.attention_inputs(buffer, batch=self.batch, member=member, start=self.window_start(start),
                                               end=end, key=key_states, value=value_states)
        if plain and (record := paged_kv_of(keys)) is not None:
            record.receipt.read = True  # the gradient path reads the gathered tokens in its place
            keys, values = layout.cached(buffer, batch=self.batch, member=member, start=self.window_start(start), end=end)
        return self._returned_keys(keys, start, end), values

    def _returned_keys(self, keys: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """The keys :meth:`update` returns for tokens ``[start, end)`` (a subclass may tag them)."""
        return keys

    def write_states(self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, *, start: int) -> None:
        """Store ``[B, H, T, D]`` states of an empty member as its tokens ``[start, start + T)``;
        tokens before ``start`` are not held (a sliding window restored on its own)."""
        member = self.member_of[layer]
        if self.lengths[member]:
            raise ArgumentError(f"layer {layer} already holds {self.lengths[member]} tokens; write_states fills an "
                                f"empty layer (write into a new cache, or reset() this one first)")
        end = start + key_states.shape[2]
        self.prepare(key_states.shape[0], 0, end)
        if start:
            self._buf().drop_before(range(self.batch), start)
            self._lay().invalidate()
            self.written_from = max(self.written_from, start)
        self._lay().write(self._buf(), batch=self.batch, member=member, start=start, key=key_states, value=value_states,
                          rows=None)
        self.lengths[member] = end

    def first_written(self) -> int:
        """The first token every row still holds written data for (0 unless pages were dropped
        behind a window or a window was restored on its own)."""
        if self.buffer is None or self.buffer.closed or not self.batch:
            return self.written_from
        return max(self.written_from, *(self.buffer.first_live(r) for r in range(self.batch)))

    def held_pages(self) -> tuple[object, int, Iterator[PageId]] | None:
        """``(store, page bytes, ids)``: every physical page the rows hold (an id as often as rows
        hold it), or ``None`` without rows."""
        if self.buffer is None or self.buffer.closed:
            return None
        store = self.buffer.store
        return store, store.page_bytes, itertools.chain.from_iterable(row.pages for row in self.buffer.table)

    def cached(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, H, T, D]`` copies of what member ``layer`` holds (``kept_from .. length``)."""
        length = self.length(layer)
        keys, values = self._lay().cached(self._buf(), batch=self.batch, member=self.member_of[layer],
                                          start=self.kept_from(layer), end=length)
        return keys.clone(), values.clone()

    def full_states(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Static layout: ``[B, H, capacity, D]`` views of member ``layer`` at fixed addresses."""
        return self._lay().full_states(self._buf(), batch=self.batch, member=self.member_of[layer])  # type: ignore[attr-defined]

    def prepare(self, batch: int, start: int, end: int) -> None:
        """Make tokens ``[start, end)`` of rows ``0..batch-1`` writable (once per step for the
        whole group): drop pages behind the window, grow, copy-on-write shared pages, and at a
        prefill of expanded prompts share each prompt's pages across its rows."""
        buffer = self._buf()
        if self._prepared == (batch, start, end):
            return
        if batch > buffer.rows and not any(buffer.length(r) for r in range(buffer.rows)):
            # an empty cache (new, or after reset()) takes a larger batch, as a DynamicCache does
            buffer = self._more_rows(batch)
        if batch > buffer.rows:
            raise LayerMismatchError(
                f"batch {batch} is larger than the {buffer.rows} rows the cache was created for; "
                f"create a new cache (or let generate() size it)"
            )
        if start > 0 and batch != self.batch:
            # continuing fewer rows than the cache holds would leave the others behind, unread; more rows would
            # read rows the cache dropped (a selection keeps their pages until they are reused) or never held
            # (DynamicCache cannot concatenate either)
            raise LayerMismatchError(
                f"batch {batch} continues a cache of {self.batch} rows; keep the rows wanted first "
                f"(cache.batch_select_indices(torch.tensor([...]))), or pass every row" if batch < self.batch else
                f"batch {batch} continues a cache of {self.batch} rows: its other {batch - self.batch} rows hold no "
                f"tokens; pass the cache's {self.batch} rows (cache.batch_repeat_interleave or reorder_cache makes "
                f"more)")
        if start == 0 and any(self.lengths) and self.prompts.applies(batch=batch, start=start, end=end):
            # sharing a prompt starts its rows afresh: the tokens members already wrote would go
            raise LayerMismatchError(
                f"group {self.name!r}: a member writes tokens [0, {end}) while others hold "
                f"{sorted(set(self.lengths) - {0})} tokens: the layers of one group must write the same tokens in a "
                f"step; give each layer its own group with cache_config={{'groups': 'layer'}}")
        rows = range(batch)
        self.prompts.settle()
        if self.sliding_window is not None and not self.record_past:
            buffer.drop_before(rows, self.window_start(start))
        if not self.prompts.start(buffer, batch=batch, start=start, end=end):
            buffer.prepare_write(rows, start, end)
        self.batch = batch
        self._lay().invalidate()
        self._prepared = (batch, start, end)
        self.version += 1

    @property
    def draws_from_a_reclaimer(self) -> bool:
        """Whether this group's memory has a reclaimer (:meth:`reclaim`): a prefix store's memory."""
        return getattr(self._arena_for, "reclaim", None) is not None

    def reclaim(self, batch: int, start: int, end: int) -> bool:
        """Ask the arenas' reclaimer (a prefix store this cache draws from) to let pages go so that
        the step of rows ``0..batch-1``, tokens ``[start, end)``, fits the budget; whether it let
        any go (then the step is tried again). Contiguous layouts only (the paged layout's blocks
        live in a store of their own)."""
        reclaim = getattr(self._arena_for, "reclaim", None)
        buffer = self.buffer
        if reclaim is None or not isinstance(buffer, VirtualBuffer) or buffer.closed:
            return False
        return bool(reclaim(pages_for_step(self, batch, start, end), buffer.store.pool))

    # ----------------------------------------------------------------------------- row operations
    def before_row_operation(self) -> None:
        """Called by the cache before each row operation (a subclass syncs what steps changed)."""

    def after_row_operation(self) -> None:
        """Called by the cache after each row operation (a subclass makes its layers follow)."""

    def reorder(self, index: Sequence[int]) -> bool:
        """Row ``i`` takes row ``index[i]``'s pages (beam search, batch selection): only the pages
        where a row's table differs from its source's move, and a row that takes a partly written
        last page another row keeps gets its own copy now, in its own page where it can (the next
        step writes there: :meth:`RowBuffer.reorder`). Returns whether a row's table changed
        (False: only bytes moved)."""
        if self.buffer is None:
            return False
        self.check_index(index, "reorder")
        if len(index) > self.buffer.rows:  # more rows than the buffer has (DynamicCache grows its batch too)
            self._more_rows(len(index))
        moved = self.buffer.reorder(index, private_tails=True, written=max(self.lengths))  # static: mapped ahead
        self.batch = len(index)
        self._changed()
        return moved

    def check_index(self, index: Sequence[int], call: str) -> None:
        """Raise (changing nothing) unless :meth:`reorder` can take ``index``: row numbers of the
        batch (:class:`CacheIndexError`); as many as wanted, as DynamicCache takes them (more rows
        than the buffer has move it to a larger one, sharing every page)."""
        if self.buffer is None:
            return
        bad = [i for i in index if not 0 <= i < self.batch]
        if bad:
            raise CacheIndexError(f"{call}: row indices {bad[:4]} are out of range for a batch of {self.batch}; pass "
                                  f"row numbers in 0..{self.batch - 1}" if self.batch else
                                  f"{call}: row indices {bad[:4]} of a cache that holds no rows")

    def repeat_rows(self, repeats: int) -> None:
        """Each row repeated ``repeats`` times, consecutively (shared pages, no copy)."""
        if self.buffer is None:
            return
        index = [r for r in range(self.batch) for _ in range(repeats)]
        if len(index) > self.buffer.rows:
            self._more_rows(len(index))
        self.buffer.reorder(index)
        self.batch = len(index)
        self._changed()

    def check_crop(self, tokens_to_remove: int) -> None:
        """Raise (changing nothing) if :meth:`crop` may not cut this group back now: a sliding
        group past its window that records no past, or one whose crop would bring back tokens it
        dropped before its recording started (``activate_past_recording`` called late)."""
        if self.sliding_window is None:
            return
        if not self.record_past and max(self.lengths) >= self.sliding_window:
            raise WindowRollbackError(
                "`crop` was called, but the current layer does not track past states, and the sliding window size "
                "was already reached. Call `activate_past_recording` before `crop` to be able to rollback the cache."
            )
        held = self.first_written()
        wanted = self.window_start(max(max(self.lengths) + tokens_to_remove, 0))
        if tokens_to_remove < 0 and wanted < held:
            raise WindowRollbackError(
                f"crop({tokens_to_remove}) would bring back tokens {wanted}..{held - 1} into group {self.name!r}'s "
                f"sliding window of {self.sliding_window}, but they were dropped before `activate_past_recording` was "
                f"called (it keeps tokens from then on): call it before the window passes the tokens a crop may take "
                f"back (crop(-{max(max(self.lengths) - self.sliding_window + 1 - held, 0)}) at most now)")

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens of every member (``tokens_to_remove <= 0``);
        a sliding group then shows its window again (``crop(0)`` too, as DynamicSlidingWindowLayer)."""
        self.lengths = [max(n + tokens_to_remove, 0) for n in self.lengths]
        if self._kept_from is not None:
            self._kept_from = self.window_start(max(self.lengths))
        if self.buffer is not None:
            length = max(self.lengths)
            if any(self.buffer.length(r) > length for r in range(self.batch)):
                self.buffer.truncate(range(self.buffer.rows), length)
                self._changed()

    def cut_to(self, length: int) -> None:
        """Keep at most the first ``length`` tokens of every member (full-attention groups): after
        a forward that stopped part-way, members may hold different counts."""
        if self.sliding_window is not None:
            raise ArgumentError(f"group {self.name!r} slides: cut_to is for full-attention groups (use crop())")
        self.lengths = [min(n, length) for n in self.lengths]
        if self.buffer is not None and any(self.buffer.length(r) > length for r in range(self.buffer.rows)):
            self.buffer.truncate(range(self.buffer.rows), length)
        self._changed()

    def start_recording(self) -> None:
        """Keep pages behind the window until :meth:`crop` (assisted decoding rolls back)."""
        if not self.record_past and self.sliding_window is not None:
            self._kept_from = self.window_start(max(self.lengths))
        self.record_past = True

    def stop_recording(self) -> None:
        """Forget the recorded past at the next step: pages behind the window go back to the pool
        when the next update prepares its rows (``keys`` shows the window again at once)."""
        self.record_past = False
        self._kept_from = None

    def clear(self) -> None:
        """Empty every row (the buffer and its reservation stay; a closed buffer refuses first,
        changing nothing)."""
        if self.buffer is not None:
            self.buffer.clear(range(self.buffer.rows))
        self.lengths = [0] * len(self.members)
        self.written_from = 0
        if self._kept_from is not None:
            self._kept_from = 0
        if self.buffer is not None:
            self.batch = 0
            self._changed()

    def take_rows(self, sources: Sequence[tuple[LayerGroup | None, int, int, int]], length: int) -> int:
        """Fill this empty full-attention group with ``len(sources)`` rows of ``length`` tokens.

        ``sources[i] = (group, row, start, offset)``: row ``i`` holds zeros at tokens
        ``[0, offset)`` (padding: finite, never attended) and then tokens ``[start, start +
        length - offset)`` of row ``row`` of ``group`` (a group of the same geometry; ``None``
        when ``offset >= length``). A source in the same page store and layout with ``start ==
        offset == 0`` is shared (pages, no copy); a source equal to an earlier row's shares
        that row's pages; any other is copied. Returns the rows copied.

        A sliding group takes shared rows only, each source holding the window the row's next token
        attends to (tokens ``[length - window + 1, length)``): its pages behind the window are gone,
        so it can neither be copied to another offset nor serve a shorter row (``ValueError``,
        nothing taken; :meth:`~hf_vkv.cache.VKVCache.min_prefix_length` says how short)."""
        if self.sliding_window is not None:
            for src, _, start, offset in sources:
                if src is None or offset >= length:
                    continue
                if start or offset:
                    raise ArgumentError(f"group {self.name!r} slides: take_rows shares its rows from token 0, it "
                                        f"cannot copy them to another offset (left padding)")
                if self.window_start(length) < src.first_written():
                    raise ArgumentError(f"group {self.name!r} slides: a row of {length} tokens needs tokens from "
                                        f"{self.window_start(length)} on, and its source holds them from "
                                        f"{src.first_written()} on")
        if any(self.lengths) or (self.buffer is not None and self.batch):
            raise ArgumentError(f"group {self.name!r} holds tokens: take_rows fills an empty group (use a new cache)")
        donors = [src for src, *_ in sources if src is not None and src.geometry is not None]
        if not donors:
            raise ArgumentError("take_rows needs at least one source holding tokens (a row with offset < length)")
        geometry = donors[0].geometry
        if any(src.geometry != geometry for src in donors) or (self.geometry not in (None, geometry)):
            raise LayerMismatchError(f"the sources of group {self.name!r} hold states of another geometry")
        if self.buffer is None:
            self._first_buffer(geometry, rows=len(sources), tokens=length)
        buffer, layout = self._buf(), self._lay()
        if len(sources) > buffer.rows:
            buffer = self._more_rows(len(sources))
        first_of: dict[tuple[int, int, int, int], int] = {}
        shared, copied, repeats = [], [], []
        for i, (src, row, start, offset) in enumerate(sources):
            key = (id(src), row, start, min(offset, length))
            if key in first_of:
                repeats.append((first_of[key], i))
                continue
            first_of[key] = i
            same = (src is not None and src.buffer is not None and src.buffer.store is buffer.store
                    and type(src.layout) is type(layout) and src.buffer.item_bytes == buffer.item_bytes)
            (shared if same and start == 0 and offset == 0 else copied).append(i)
        if copied and self.sliding_window is not None:
            raise ArgumentError(f"group {self.name!r} slides: take_rows shares its rows from a source of its own page "
                                f"store and layout, and cannot copy them")
        for i in shared:
            src, row, _, _ = sources[i]
            buffer.adopt(i, src._buf(), row, length=length)
        if copied:
            buffer.prepare_write(copied, 0, length)
        followers: dict[int, list[int]] = {}
        for first, i in repeats:
            followers.setdefault(first, []).append(i)
        for first, rows in followers.items():  # before the copies are written: a view covers only mapped rows
            buffer.share(first, rows, length=length)
        layout.invalidate()
        for member in range(len(self.members)):
            for i in copied:
                self._copy_row(member, i, sources[i], length, len(sources))
        self.batch = len(sources)
        self.lengths = [length] * len(self.members)
        self._changed()
        return len(copied)

    def check_take_over(self, src: LayerGroup) -> Layout:
        """Raise ``ValueError`` unless :meth:`take_over` can take ``src``'s row: both full-attention
        groups of the same members in one page store, this one empty, ``src`` one row whose members
        hold the same tokens, in a layout of the same kind with at least this group's capacity.
        Returns the layout this group would hold it in (its own, or a new one; nothing changes)."""
        buffer = src.buffer
        fits = (self.sliding_window is None and src.sliding_window is None and type(self) is LayerGroup
                and type(src) is LayerGroup and self.members == src.members and buffer is not None
                and src.geometry is not None and src.layout is not None and src.batch == 1
                and len(set(src.lengths)) == 1 and src.lengths[0] > 0 and buffer.rows == 1
                and buffer.capacity >= self._within_budget(getattr(buffer.store, "budget_bytes", None), src.lengths[0],
                                                           src.geometry)
                and self.geometry in (None, src.geometry)
                and not any(self.lengths) and (self.buffer is None or not self.batch))
        layout = self.layout or (self._make_layout(src.geometry, len(self.members)) if fits else None)
        if not fits or type(layout) is not type(src.layout) \
                or self._arena_for(src.geometry.device, layout) is not buffer.store:
            raise ArgumentError(f"group {self.name!r} cannot take over group {src.name!r}'s row (one full-attention "
                                f"row of the same layers, layout and memory, into an empty group)")
        return layout

    def take_over(self, src: LayerGroup) -> None:
        """Hold ``src``'s one row by taking its buffer: no page is mapped, copied or unmapped;
        ``src`` is left without a buffer (empty). :meth:`check_take_over` says when it can."""
        layout = self.check_take_over(src)
        buffer = src._buf()
        if self.buffer is not None:
            self.buffer.close()
        self.geometry, self.layout, self.buffer, self.capacity = src.geometry, layout, buffer, buffer.capacity
        self.batch, self.lengths, self.written_from = 1, list(src.lengths), src.written_from
        src.buffer, src.batch, src.lengths, src.written_from = None, 0, [0] * len(src.members), 0
        src._changed()
        self._changed()

    def _copy_row(self, member: int, i: int, source: tuple[LayerGroup | None, int, int, int], length: int,
                  batch: int) -> None:
        """Write row ``i``'s tokens of member ``member`` (see :meth:`take_rows`): zeros, then the source's."""
        src, row, start, offset = source
        layout, buffer = self._lay(), self._buf()
        offset = min(offset, length)
        g = self.geometry
        if offset:
            zk = torch.zeros(1, g.kv_heads, offset, g.key_dim, dtype=g.dtype, device=g.device)
            zv = torch.zeros(1, g.kv_heads, offset, g.value_dim, dtype=g.dtype, device=g.device)
            layout.write(buffer, batch=batch, member=member, start=0, key=zk.expand(batch, -1, -1, -1),
                         value=zv.expand(batch, -1, -1, -1), rows=[i])
        if offset < length:
            assert src is not None
            keys, values = src._lay().cached(src._buf(), batch=src.batch, member=member, start=start,
                                             end=start + length - offset)
            layout.write(buffer, batch=batch, member=member, start=offset,
                         key=keys[row:row + 1].expand(batch, -1, -1, -1),
                         value=values[row:row + 1].expand(batch, -1, -1, -1), rows=[i])

    def row_image(self) -> GroupImage:
        """Row 0 as page tables (:class:`GroupImage`): a full-attention group of one row whose
        members hold the same tokens. Raises ``ValueError`` for any other."""
        buffer = self.buffer
        if self.sliding_window is not None or buffer is None or self.geometry is None or self.layout is None \
                or self.batch != 1 or len(set(self.lengths)) != 1 or not self.lengths[0] or type(self) is not LayerGroup:
            raise ArgumentError(f"group {self.name!r}: a row image is of one full-attention row whose layers hold "
                                f"the same tokens (batch {self.batch}, lengths {sorted(set(self.lengths))})")
        table = buffer.table
        return GroupImage(name=self.name, members=self.members, geometry=self.geometry,
                          layout=type(self.layout).__name__, item_bytes=buffer.item_bytes, parts=buffer.parts,
                          page_bytes=buffer.store.page_bytes, lengths=tuple(self.lengths),
                          tables=tuple(table.row(t) for t in buffer.table_rows(0)), store=buffer.store)

    def arena_for_image(self, image: GroupImage) -> Arena:
        """The arena :meth:`install_row` would put ``image``'s row in (where its pages must live).
        An empty group that has no buffer yet makes none for this: its layout for ``image``'s
        geometry says the shape of the rows it would hold (a mapped prefix file checks its entries
        against a store's memory, which never holds a row). Raises ``ValueError`` if the image does
        not fit this group (members, geometry, layout, buffer shape, page size)."""
        if self.sliding_window is not None or type(self) is not LayerGroup:
            raise ArgumentError(f"group {self.name!r} takes no row image (a sliding window, or a cascade/static group)")
        if image.members != self.members or (self.geometry is not None and image.geometry != self.geometry):
            raise ArgumentError(f"group {self.name!r}: the image is of layers {image.members[:4]}... with "
                                f"{image.geometry.describe()}, not this group's")
        if self.buffer is None:
            layout = self._make_layout(image.geometry, len(self.members))
            arena = self._arena_for(image.geometry.device, layout)  # the one _first_buffer would draw from
            store = arena if layout.draws_from_arena else None
            shape = (type(layout).__name__, layout.item_bytes, layout.row_parts, arena.page_bytes)
        else:
            buffer = self.buffer
            store = buffer.store
            shape = (type(self._lay()).__name__, buffer.item_bytes, buffer.parts, buffer.store.page_bytes)
        if shape != (image.layout, image.item_bytes, image.parts, image.page_bytes):
            raise ArgumentError(
                f"group {self.name!r} holds rows {layout_option(shape[0])} in {shape[3]:,}-byte pages ({shape[1]:,} "
                f"bytes a token, {shape[2]} part(s) a row), the saved row {layout_option(image.layout)} in "
                f"{image.page_bytes:,}-byte pages ({image.item_bytes:,} bytes a token, {image.parts} part(s)): load it "
                f"where the memory has its layout and page size (PrefixStore(config, cache_config={{'layout': "
                f"{layout_option(image.layout)!r}, 'page_bytes': {image.page_bytes}}}))")
        if not isinstance(store, Arena):
            raise ArgumentError(f"group {self.name!r} draws its pages from a block store, not an arena")
        return store

    def install_row(self, image: GroupImage) -> None:
        """Make this empty group hold ``image``'s row as row 0, on the image's pages (in use in
        :meth:`arena_for_image`'s arena); no bytes move. Raises ``ValueError`` (nothing changed)
        if the group holds tokens or the image does not fit."""
        if any(self.lengths) or (self.buffer is not None and self.batch):
            raise ArgumentError(f"group {self.name!r} holds tokens: install_row fills an empty group (use a new cache)")
        self.arena_for_image(image)
        if self.buffer is None:
            self._first_buffer(image.geometry, rows=1, tokens=max(image.lengths), fit=True)
        self._buf().install(0, list(image.tables))
        self.batch = 1
        self.lengths = list(image.lengths)
        self._changed()

    def _more_rows(self, rows: int) -> RowBuffer:
        """Move to a buffer of ``rows`` rows sharing every page (a remap, no copy)."""
        old = self._buf()
        self.buffer = old.fork(rows=rows)
        old.close()
        return self.buffer

    # ----------------------------------------------------------------------------- life cycle
    def fork(self, arena_for: Callable[[torch.device, Layout], Arena]) -> LayerGroup:
        """A copy sharing every page (zero copy); both sides copy a page only when writing it."""
        other = type(self)(name=self.name, members=self.members, sliding_window=self.sliding_window,
                           make_layout=self._make_layout, arena_for=arena_for, rows_hint=self._rows_hint,
                           capacity=self.capacity, prompt_repeats=self.prompts.repeats,
                           share_prompts=self.prompts.enabled, **self._twin_options())
        other.geometry = self.geometry
        other.batch = self.batch
        other.lengths = list(self.lengths)
        other.record_past = self.record_past
        other._kept_from = self._kept_from
        other.written_from = self.written_from
        if self.buffer is not None and self.geometry is not None:
            other.layout = self._make_layout(self.geometry, len(self.members))
            other.buffer = self.buffer.fork()
        return other

    def _twin_options(self) -> dict[str, Any]:
        """Constructor options of a subclass that :meth:`fork` passes on."""
        return {}

    def close(self) -> None:
        if self.buffer is not None:
            self.buffer.close()
            self._changed()  # drop the views kept: they cover unmapped memory now

    def stats(self) -> BufferStats | None:
        return None if self.buffer is None or self.buffer.closed else self.buffer.stats()

    def check_invariants(self) -> None:
        """Check the invariants of the module docstring and the buffer's own."""
        if self.buffer is None or self.buffer.closed:
            return
        self.buffer.check_invariants()
        self.buffer.check_shared_parts(range(self.batch))
        longest = max(self.lengths)
        for r in range(self.buffer.rows):
            held = self.buffer.length(r)
            if r < self.batch and held < longest:
                raise InvariantError(f"group {self.name!r}: row {r} holds {held} tokens, a member has {longest}")
            if r >= self.batch and held:
                raise InvariantError(f"group {self.name!r}: row {r} is past the batch ({self.batch}) but holds tokens")
            if r < self.batch and held and self.buffer.first_live(r) > self.window_start(min(self.lengths)):
                raise InvariantError(f"group {self.name!r}: row {r} dropped tokens its window still needs")

    def _changed(self) -> None:
        self.prompts.settle()
        self.version += 1
        if self.layout is not None:
            self.layout.invalidate()
        self._prepared = None
