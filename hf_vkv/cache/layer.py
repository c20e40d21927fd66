"""Per-layer cache objects: the transformers ``CacheLayerMixin`` contract over a layer group.

:class:`VKVLayer` behaves like ``DynamicLayer`` and :class:`VKVSlidingLayer` like
``DynamicSlidingWindowLayer`` (same sequence lengths, mask sizes and returned K/V, bit for bit),
but ``update`` writes the new tokens in place and returns views, with no concatenation. A layer
holds no state of its own: its length, rows and pages are its group's. Row operations
(reorder, select, repeat, crop, reset) are the cache's (:class:`~hf_vkv.cache.VKVCache`), which
calls each group once.

With autograd on, ``update`` stores detached states and returns ``torch.cat([cached, new])``, so
the tokens of that forward carry their history while cached tokens are data in pages, as in a
``StaticCache`` (:mod:`hf_vkv.cache.grad`).
"""

from __future__ import annotations

import contextlib
import copy
import operator
from collections.abc import Sequence
from typing import Any

import torch
from transformers.cache_utils import CacheLayerMixin

from .grad import VKVGradientError, refuse_trainable_states, tracks_grad, with_new_states
from ..memory import KVCacheOutOfMemory, VKVError
from ..memory.errors import ArgumentError, ArgumentTypeError, CacheIndexError
from .group import LayerGroup
from .static_group import StaticGroup
from .oom import STORE_BUDGET, step_out_of_memory

__all__ = ["LayerCallError", "VKVLayer", "VKVSlidingLayer", "VKVStaticLayer", "int_argument", "reorder_rows",
           "repeats_argument", "selected_rows"]


def int_argument(value: Any, name: str) -> int:
    """``value`` as an int (an int, a numpy integer, a one-element integer tensor); an
    :class:`ArgumentTypeError` naming ``name`` (``"fork(length)"``) otherwise (a float, a bool, a str)."""
    if not isinstance(value, bool) and not (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        with contextlib.suppress(TypeError):
            return operator.index(value)
    raise ArgumentTypeError(f"{name} takes an int, got {type(value).__name__} {value!r}")


def reorder_rows(beam_idx: Any) -> list[int]:
    """The row numbers of a ``reorder_cache(beam_idx)`` (a 1-d integer tensor, any device, as
    ``DynamicCache`` takes it), in one host transfer; :class:`ArgumentTypeError` otherwise (a
    bool mask, floats, a list, a 2-d tensor)."""
    if not isinstance(beam_idx, torch.Tensor) or beam_idx.is_floating_point() or beam_idx.is_complex() \
            or beam_idx.dtype == torch.bool or beam_idx.dim() != 1:
        raise ArgumentTypeError(f"reorder_cache takes a 1-d integer tensor of row indices (beam_idx), got "
                                f"{getattr(beam_idx, 'dtype', type(beam_idx).__name__)} "
                                f"{tuple(getattr(beam_idx, 'shape', ()))}; pass e.g. beam_idx.long()")
    return [int(i) for i in beam_idx.tolist()]


def repeats_argument(repeats: Any) -> int:
    """The ``repeats`` of a ``batch_repeat_interleave``: an int >= 1 (:class:`ArgumentTypeError`,
    :class:`ArgumentError` otherwise)."""
    repeats = int_argument(repeats, "batch_repeat_interleave(repeats)")
    if repeats < 1:
        raise ArgumentError(f"batch_repeat_interleave: repeats must be >= 1, got {repeats} (1 keeps the batch; "
                            f"reset() or batch_select_indices drop rows)")
    return repeats


def selected_rows(indices: torch.Tensor | Sequence[int] | slice, rows: int) -> list[int]:
    """The row numbers a ``batch_select_indices(indices)`` keeps of ``rows`` (row numbers,
    negative ones, a bool mask, a tensor or a sequence of them, a slice, as ``DynamicCache``
    selects its batch dimension): :class:`ArgumentTypeError` or :class:`CacheIndexError` naming
    them otherwise (a single int, which would drop the batch dimension, among them)."""
    if isinstance(indices, slice):
        try:
            return list(range(rows)[indices])
        except (TypeError, ValueError) as e:
            raise ArgumentTypeError(f"batch_select_indices: the slice {indices!r} does not select rows ({e})") from None
    if not isinstance(indices, torch.Tensor):
        try:
            given = list(indices)
        except TypeError:
            raise ArgumentTypeError(f"batch_select_indices takes row numbers or a bool mask (a tensor, a sequence of "
                                    f"ints or bools, or a slice), got {type(indices).__name__} {indices!r:.40}; pass "
                                    f"[i] to keep row i") from None
        try:
            indices = torch.tensor(given, dtype=torch.bool if given and all(isinstance(i, bool) for i in given)
                                   else torch.long)
        except (TypeError, ValueError, RuntimeError):
            raise ArgumentTypeError(f"batch_select_indices takes row numbers or a bool mask (a tensor or a "
                                    f"sequence of ints or bools), got {given[:4]!r}") from None
    if indices.is_floating_point() or indices.is_complex():
        raise ArgumentTypeError(f"batch_select_indices takes an integer tensor of row numbers or a bool mask, got "
                                f"{indices.dtype}; pass e.g. indices.long()")
    cpu = indices.cpu()
    try:
        index = torch.arange(rows)[cpu].reshape(-1).tolist()
    except IndexError:
        if cpu.dtype == torch.bool:
            raise CacheIndexError(f"batch_select_indices: a bool mask of shape {tuple(cpu.shape)} for a batch of "
                                  f"{rows} rows; pass one entry per row ({rows})") from None
        bad = [i for i in cpu.reshape(-1).tolist() if not -rows <= i < rows]
        raise CacheIndexError(f"batch_select_indices: rows {bad[:4]} are outside the batch of {rows} rows; pass "
                              f"row numbers in {-rows}..{rows - 1}" if rows else
                              f"batch_select_indices: rows {bad[:4]} of an empty cache (it holds no rows yet)"
                              ) from None
    return index


class LayerCallError(VKVError, NotImplementedError):
    """A row operation a layer cannot do: called on one layer whose rows are shared with other
    layers (its group's; the message names the cache-level call that does it), or called on a
    cache that keeps layers of transformers' own classes lacking it (transformers'
    ``LinearAttentionLayer`` selects and repeats no rows): refused before anything changes."""


class VKVLayer(CacheLayerMixin):
    """One full-attention layer's view of its group.

    ``keys`` / ``values`` are ``[B, H, S, D]`` copies of what is cached (``update`` returns
    zero-copy views, which attention uses at once).
    """

    is_sliding = False
    is_croppable = True
    is_compileable = False
    #: Whether the layer keeps state of transformers' beside its group's K/V (a hybrid layer's
    #: linear state, :mod:`hf_vkv.cache.hybrid`): the cache's row operations must move it too.
    keeps_transformers_state = False

    def __init__(self, group: LayerGroup, layer_idx: int) -> None:
        self.group = group
        self.layer_idx = layer_idx
        super().__init__()

    # The mixin's __init__ assigns None to keys/values; here they are read from the group. As
    # copies: a caller may keep them (as DynamicLayer's), and a kept view would change under later
    # reorders and copy-on-write, and kill the process with SIGSEGV once its pages are unmapped.
    @property
    def keys(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.group.cached(self.layer_idx)[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.keys is read from the cache; write through update()")

    @property
    def values(self) -> torch.Tensor | None:  # type: ignore[override]
        return self.group.cached(self.layer_idx)[1] if self.is_initialized else None

    @values.setter
    def values(self, value: Any) -> None:
        if value is not None:
            raise AttributeError("VKVLayer.values is read from the cache; write through update()")

    @property
    def dtype(self) -> torch.dtype | None:
        g = self.group.geometry
        return None if g is None else g.dtype

    @property
    def device(self) -> torch.device | None:
        g = self.group.geometry
        return None if g is None else g.device

    # ----------------------------------------------------------------------------- the contract
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Join the group with the first states (``[B, H, q, D]``); the group checks they match."""
        self.group.init_layer(self.layer_idx, key_states, value_states)
        self.is_initialized = True

    def adopt_group(self) -> None:
        """The group was filled with rows taken from other caches (:meth:`VKVCache.take_rows`,
        which made its geometry and buffer): the layer holds its tokens from now on."""
        if self.group.geometry is None:
            raise ArgumentError(f"layer {self.layer_idx}: its group holds no rows to adopt (fill the cache with "
                                f"VKVCache.take_rows, take_over or install_row first)")
        self.is_initialized = True

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``[B, H, q, D]`` states after the cached tokens; return ``[B, H, kv_length, D]``
        views of everything attention needs (``kv_length`` as given by :meth:`get_mask_sizes`),
        or in the paged layout the new states tagged for the ``"vkv_paged"`` attention.

        With autograd on (:func:`~hf_vkv.cache.grad.tracks_grad`) the pages get detached copies
        and the result is new ``[B, H, kv_length, D]`` tensors: the cached tokens (data, no
        history) followed by the states themselves (with history), as ``DynamicLayer`` returns
        them. Raises :class:`~hf_vkv.cache.grad.VKVGradientError` for leaf states requiring grad
        (a trainable prefix: later forwards could not give its gradient)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        tracked = tracks_grad(key_states, value_states)
        if tracked:
            refuse_trainable_states(key_states, value_states, layer_idx=self.layer_idx)
        while True:
            try:
                keys, values = self.group.update(self.layer_idx, key_states.detach() if tracked else key_states,
                                                 value_states.detach() if tracked else value_states, plain=tracked)
                break
            except KVCacheOutOfMemory as error:
                start = self.group.length(self.layer_idx)  # unchanged: the step failed before writing
                batch, end = key_states.shape[0], start + key_states.shape[-2]
                # a prefix store drawing from the same budget lets entries go, oldest first: try again
                if not self.group.reclaim(batch, start, end):
                    # restated for the whole step: its total, what is free, a budget that fits
                    raise step_out_of_memory(self.group, batch, start, end, error,
                                             budget=STORE_BUDGET if self.group.draws_from_a_reclaimer else None) from None
        return self._returned(keys, values, key_states, value_states, tracked=tracked)

    def _returned(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
                  value_states: torch.Tensor, *, tracked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``update`` returns once the group stored the states and gave back ``keys``/``values``
        (``[B, H, kv_length, D]``, or the fused paged layout's tagged new states when not ``tracked``):
        with autograd on, the cached tokens followed by the states with their history."""
        return with_new_states(keys, values, key_states, value_states) if tracked else (keys, values)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        """Tokens cached; 0 for a cache of no rows, as ``DynamicLayer`` (its tensors are empty)."""
        return self.group.length(self.layer_idx) if self.group.batch else 0

    def get_max_length(self) -> int:
        return -1

    # ----------------------------------------------------- DynamicLayer's row operations, one layer
    # A layer's rows and pages are its group's: alone in its group (``groups="layer"``) a layer
    # does what DynamicLayer does; sharing it, the operation would change every member, so it is
    # refused with the cache-level call (which changes every group once).
    def _alone(self, call: str) -> LayerGroup:
        """The group, if this layer may change its rows by itself; else :class:`LayerCallError`."""
        shared = len(self.group.members) > 1
        if shared or self.is_compileable or self.keeps_transformers_state:
            why = (f"its rows and pages are shared by the layers {list(self.group.members)} of its group"
                   if shared else "its cache keeps other state in step with it (a static length or a linear state)")
            raise LayerCallError(
                f"VKVLayer.{call.split('(')[0]} on layer {self.layer_idx}: {why}; call the cache's {call} (VKVCache."
                f"{call.split('(')[0]}), which does it for every layer at once"
                + (", or build the cache with groups='layer' to change layers one by one" if shared else ""))
        return self.group

    def crop(self, tokens_to_remove: int) -> None:
        """Remove the last ``-tokens_to_remove`` tokens (a negative int), as ``DynamicLayer.crop``."""
        tokens_to_remove = int_argument(tokens_to_remove, "crop(tokens_to_remove)")
        if tokens_to_remove > 0:
            raise ArgumentError(
                f"Calling `crop` with a positive value (`{tokens_to_remove}`) is not supported. "
                "Please use a negative integer to remove that number of tokens from the cache instead."
            )
        group = self._alone(f"crop({tokens_to_remove})")
        if (tokens_to_remove == 0 and not self.is_sliding) or not self.is_initialized:
            return
        group.check_crop(tokens_to_remove)
        group.crop(tokens_to_remove)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Row ``i`` takes row ``beam_idx[i]``'s pages (no copy), as ``DynamicLayer.reorder_cache``."""
        index = reorder_rows(beam_idx)
        group = self._alone("reorder_cache(beam_idx)")
        if self.get_seq_length() > 0:
            group.check_index(index, "reorder_cache(beam_idx)")
            group.reorder(index)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (an index or bool tensor), as ``DynamicLayer.batch_select_indices``."""
        group = self._alone("batch_select_indices(indices)")
        if self.get_seq_length() > 0:
            index = selected_rows(indices, group.batch)
            group.check_index(index, "batch_select_indices(indices)")
            group.reorder(index)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (pages shared), as ``DynamicLayer.batch_repeat_interleave``."""
        repeats = repeats_argument(repeats)
        group = self._alone(f"batch_repeat_interleave({repeats})")
        if self.get_seq_length() > 0:
            group.repeat_rows(repeats)

    def reset(self) -> None:
        """Forget the cached tokens (pages go back to the pool), as ``DynamicLayer.reset``."""
        group = self._alone("reset()")
        if self.is_initialized:
            group.clear()

    def twin(self, group: LayerGroup) -> VKVLayer:
        """This layer over ``group``, a fork of its own group (:meth:`VKVCache.fork`): the same
        layer; a subclass copies what it keeps besides its group's state."""
        other = copy.copy(self)
        other.group = group
        return other

    def offload(self) -> None:
        """Pages stay where they are: nothing to move."""

    def prefetch(self) -> None:
        """Pages stay where they are: nothing to fetch."""


class VKVSlidingLayer(VKVLayer):
    """A sliding-window (or chunked) layer: returns the last ``window - 1`` cached tokens plus the
    new ones, like ``DynamicSlidingWindowLayer``; pages wholly behind the window go back to the pool."""

    is_sliding = True

    def __init__(self, group: LayerGroup, layer_idx: int, *, sliding_window: int) -> None:
        self.sliding_window = sliding_window
        super().__init__(group, layer_idx)

    @property
    def cumulative_length(self) -> int:
        return self.get_seq_length()

    @property
    def record_past(self) -> bool:
        """Whether pages behind the window are kept until :meth:`crop` (``DynamicSlidingWindowLayer``'s flag;
        transformers sets it back to ``False`` on every layer when it hands a cache back)."""
        return self.group.record_past

    @record_past.setter
    def record_past(self, value: bool) -> None:
        if value:
            self.group.start_recording()
        else:
            self.group.stop_recording()

    def activate_past_recording(self, **kwargs: Any) -> None:
        """Keep the tokens behind the window until :meth:`crop`, as ``DynamicSlidingWindowLayer``
        (assisted decoding and multi-token prediction call it on the cache or on each layer;
        ``kwargs``, transformers' ``recurrent_states_to_keep``, concern recurrent states). The
        group records for all its members: pages make keeping the past cheap."""
        self.group.start_recording()

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        length = self.get_seq_length()
        offset = self.group.window_start(length)
        return length - offset + query_length, offset

    def get_max_length(self) -> int:
        return self.sliding_window


class VKVStaticLayer(VKVLayer):
    """A full-attention layer in the static layout: ``StaticLayer``'s contract over virtual memory.

    ``update`` returns full-capacity ``[B, H, max_tokens, D]`` views at fixed addresses, the mask
    covers the capacity, and the length is a tensor (``cumulative_length``) advanced in place.
    Eagerly, ``update`` runs the group's page-table work itself; inside a compiled step it only
    writes with ``index_copy_`` at the tensor positions, into pages
    :meth:`~hf_vkv.VKVCache.map_ahead` made writable before the step.
    """

    is_compileable = True

    def __init__(self, group: StaticGroup, layer_idx: int) -> None:
        super().__init__(group, layer_idx)
        group.attach(self)
        self.max_cache_len = group.capacity
        # a tensor, as StaticLayer's: a compiled step reads and advances it without recompiling
        self.cumulative_length = torch.tensor(0, dtype=torch.long)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.cumulative_length = self.cumulative_length.to(key_states.device)
        if not torch.compiler.is_compiling():
            torch._dynamo.mark_static_address(self.cumulative_length)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not torch.compiler.is_compiling():  # eagerly: VKVLayer's path (page tables, grad, out of memory)
            return super().update(key_states, value_states)
        tracked = tracks_grad(key_states, value_states)
        if tracked:
            raise VKVGradientError(
                f"layer {self.layer_idx}: a compiled step of the static layout writes into pages in place and cannot "
                f"record gradients; compile the forward under torch.no_grad(), or run it eagerly")
        keys, values = self.full_keys, self.full_values  # fixed addresses, set by the eager prefill
        positions = torch.arange(key_states.shape[-2], device=keys.device) + self.cumulative_length
        self.cumulative_length.add_(key_states.shape[-2])
        keys.index_copy_(2, positions, key_states)
        values.index_copy_(2, positions, value_states)
        return keys, values

    def _returned(self, keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
                  value_states: torch.Tensor, *, tracked: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Keep the full-capacity views and the length; with autograd on, the views with the new
        tokens' states (with history) put in place out of place, as ``StaticLayer``'s ``index_copy_``."""
        self.full_keys, self.full_values = keys, values
        length = self.group.length(self.layer_idx)
        self.cumulative_length.fill_(length)
        if not tracked:
            return keys, values
        positions = torch.arange(length - key_states.shape[-2], length, device=keys.device)
        return keys.index_copy(2, positions, key_states), values.index_copy(2, positions, value_states)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.max_cache_len, 0

    def twin(self, group: StaticGroup) -> VKVStaticLayer:  # type: ignore[override]
        """Its own length tensor (advanced in place by compiled steps) and full views of ``group``'s
        pages (a fork sharing this layer's would write into this cache)."""
        other = super().twin(group)
        group.attach(other)
        other.cumulative_length = self.cumulative_length.clone()
        if self.is_initialized:
            if not torch.compiler.is_compiling():
                torch._dynamo.mark_static_address(other.cumulative_length)
            other.full_keys, other.full_values = group.full_states(self.layer_idx)
        return other

    def get_seq_length(self) -> Any:
        return self.cumulative_length if self.is_initialized else 0

    def get_max_length(self) -> int:
        return self.max_cache_len

    def written_length(self) -> int:
        """The tokens written so far, compiled steps included (a host read of the length tensor)."""
        return int(self.cumulative_length)

    def follow_rows(self) -> None:
        """After a row operation that changed the batch (select, repeat): full views of the
        group's rows now (the addresses of rows that stay are unchanged)."""
        if getattr(self, "full_keys", None) is not None and self.full_keys.shape[0] != self.group.batch:
            self.full_keys, self.full_values = self.group.full_states(self.layer_idx)

    def set_length(self, length: int) -> None:
        """Follow the group after a row operation changed the length (crop, reset)."""
        self.cumulative_length.fill_(length)
