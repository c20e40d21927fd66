"""Hybrid layers: transformers' linear/recurrent state beside attention K/V kept in a layer group.

transformers' ``"hybrid"`` and ``"hybrid_sliding"`` layer types (Falcon-H1, Zamba2, Inkling2, ...)
hold two things in one layer: the conv/recurrent states of a Mamba-like mixer and the K/V of an
attention block. Here the two are split:

* the linear state is a real transformers ``LinearAttentionLayer`` (:attr:`VKVHybridLayer.linear`),
  kept and updated by transformers' own code, bit for bit as in ``DynamicCache``;
* the attention K/V belong to a :class:`~hf_vkv.cache.group.LayerGroup`, exactly like a
  :class:`~hf_vkv.cache.layer.VKVLayer`'s (the group holds lengths, rows and pages).

Class identity matters to transformers: ``Cache.is_linear``, ``get_seq_length``,
``get_mask_sizes``, ``has_previous_state`` and ``update_conv_state`` pick layers by ``isinstance``.
So :class:`VKVHybridLayer` *is* a ``LinearAttentionAndFullAttentionLayer`` (``is_linear`` False)
and :class:`VKVHybridSlidingLayer` a ``LinearAttentionAndSlidingWindowAttentionLayer``
(``is_linear`` True, as transformers reports it), and their linear attributes (``conv_states``,
``recurrent_states``, ``has_previous_state``, ``record_past``, ...) read and write :attr:`linear`.

Row operations are the cache's: :class:`~hf_vkv.cache.VKVCache` moves each group once (every
member's K/V rows at a time) and then calls the same operation on :attr:`linear` (see
:func:`transformers_part`), so the linear state gets each call exactly once and the attention
part none. Calling a row operation on the hybrid layer itself is refused: it cannot move its K/V
rows without moving every other member of its group.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.cache_utils import (
    CacheLayerMixin,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionAndSlidingWindowAttentionLayer,
    LinearAttentionLayer,
)

from ..memory.errors import ArgumentTypeError, VKVError
from .group import LayerGroup
from .layer import LayerCallError, VKVLayer, VKVSlidingLayer

__all__ = ["LinearState", "RecurrentRollbackError", "VKVHybridLayer", "VKVHybridSlidingLayer", "cuts_back_unrecorded",
           "make_vkv_layer", "transformers_part"]

#: Layer types whose attention K/V a group holds beside a linear state.
HYBRID_KINDS = ("hybrid", "hybrid_sliding")


class RecurrentRollbackError(VKVError, RuntimeError):
    """A crop would cut tokens out of a recurrent state, which folds every past token in and cannot
    be cut back (transformers' layer would crop the conv state alone and keep a wrong state)."""


class LinearState(LinearAttentionLayer):
    """transformers' ``LinearAttentionLayer`` plus the two batch operations it lacks, and a crop
    that refuses what it cannot do exactly.

    States are ``conv_states[i]``: ``[B, C, kernel]`` (more tokens while recording the past) and
    ``recurrent_states[i]``: ``[B, ...]``; row ``r`` is index ``r`` of dimension 0, so selecting
    and repeating rows index dimension 0 as ``reorder_cache`` does. (``DynamicCache`` moves only
    the K/V of a hybrid layer here and leaves its linear state at the old batch.)
    """

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop (conv states back to ``kernel`` tokens, ``-tokens_to_remove`` fewer);
        :class:`RecurrentRollbackError` if that would remove tokens from a recurrent state whose
        past states were not recorded (without ``activate_past_recording`` transformers' own
        refusal comes first). From transformers 5.25 a recording layer keeps the recurrent state
        before each token it folds in (``recurrent_states_history``; speculative decoding asks for
        it): a crop back over at most that many tokens restores the recorded state, as
        ``DynamicCache`` does; before 5.25 nothing is recorded and every such crop is refused."""
        self.check_crop(tokens_to_remove)
        super().crop(tokens_to_remove)

    def check_crop(self, tokens_to_remove: int) -> None:
        """:class:`RecurrentRollbackError` where :meth:`crop` would refuse; nothing changes."""
        removed = -tokens_to_remove
        if self.record_past and removed > 0 and any(
                initialized and len(self._recorded(i)) < removed
                for i, initialized in self.is_recurrent_states_initialized.items()):
            raise RecurrentRollbackError(
                f"cannot remove {removed} token(s): a recurrent (SSM / linear-attention) state holds every past "
                "token folded in and cannot be cut back past the states recorded since activate_past_recording "
                "(transformers >= 5.25 records them). Keep the cache whole (fork() with no length), or prefill the "
                "shorter prefix again"
            )

    def _recorded(self, state_idx: int) -> list[torch.Tensor]:
        """The recurrent states recorded since :meth:`activate_past_recording` (transformers >= 5.25; none before)."""
        history = getattr(self, "recurrent_states_history", None)
        return history.get(state_idx, []) if isinstance(history, dict) else []

    def _take_rows(self, index: torch.Tensor) -> None:
        for i in range(self.number_of_states):
            if self.is_conv_states_initialized[i]:
                self.conv_states[i] = self.conv_states[i][index.to(self.conv_states[i].device)]
            if self.is_recurrent_states_initialized[i]:
                self.recurrent_states[i] = self.recurrent_states[i][index.to(self.recurrent_states[i].device)]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows ``indices`` (row numbers or a bool mask over dimension 0)."""
        self._take_rows(torch.as_tensor(indices))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times, consecutively."""
        rows = next((s.shape[0] for s in (*self.conv_states.values(), *self.recurrent_states.values())
                     if s is not None), 0)
        self._take_rows(torch.arange(rows).repeat_interleave(repeats))


class _OnLinear:
    """An attribute of the hybrid layer that is its linear state's (read and written there)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, layer: Any, owner: type | None = None) -> Any:
        return self if layer is None else getattr(layer.linear, self.name)

    def __set__(self, layer: Any, value: Any) -> None:
        setattr(layer.linear, self.name, value)


class _HybridParts:
    """What both hybrid classes add to their attention layer: the linear state and its API."""

    linear: LinearState
    number_of_states = _OnLinear()
    conv_states = _OnLinear()
    recurrent_states = _OnLinear()
    is_conv_states_initialized = _OnLinear()
    is_recurrent_states_initialized = _OnLinear()
    has_previous_state = _OnLinear()
    conv_kernel_size = _OnLinear()
    record_past = _OnLinear()  # Cache.is_recording_past and the models read it; 5.17 reads it on the layer
    # transformers >= 5.25: the linear state's token count (its increase_count, called on the
    # layer, adds to it) and its recording of past recurrent states
    cumulative_length_linear = _OnLinear()
    recurrent_states_to_keep = _OnLinear()
    recurrent_states_history = _OnLinear()
    supports_early_init = False  # as transformers' hybrid layers: the linear state has no K/V shapes to guess
    is_compileable = False
    keeps_transformers_state = True  # VKVLayer's flag: the linear state (see transformers_part)

    def _init_parts(self, group: LayerGroup, layer_idx: int, number_of_states: int) -> None:
        # not VKVLayer.__init__: its super() would run transformers' hybrid __init__, which assigns
        # the linear attributes (and device/dtype, the group's here) on this object
        self.linear = LinearState(number_of_states=number_of_states)
        self.group = group
        self.layer_idx = layer_idx
        CacheLayerMixin.__init__(self)  # type: ignore[arg-type]

    @property
    def is_croppable(self) -> bool:
        """Whether ``crop`` can roll the layer back: never once it holds a recurrent state."""
        return self.linear.is_croppable

    def lazy_initialization(self, *args: Any, **kwargs: Any) -> None:
        """``(key_states, value_states)``: join the group; keywords (``conv_states=``,
        ``recurrent_states=``, ``state_idx=``, ...): initialise the linear state (transformers' dispatch)."""
        if len(args) == 2 and not kwargs:
            VKVLayer.lazy_initialization(self, *args)  # type: ignore[arg-type]
        elif not args:
            self.linear.lazy_initialization(**kwargs)
        else:
            raise ArgumentTypeError("lazy_initialization takes (key_states, value_states) or linear states by keyword")

    def update_conv_state(self, conv_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """transformers' ``LinearAttentionLayer.update_conv_state`` (``[B, C, q]`` in, ``[B, C, >= kernel]`` out)."""
        return self.linear.update_conv_state(conv_states, state_idx, **kwargs)

    def update_recurrent_state(self, recurrent_states: torch.Tensor, state_idx: int = 0, **kwargs: Any) -> torch.Tensor:
        """transformers' ``LinearAttentionLayer.update_recurrent_state``."""
        return self.linear.update_recurrent_state(recurrent_states, state_idx, **kwargs)

    def get_max_length(self) -> int:
        """-1, as transformers' hybrid layers report (their linear part's answer comes first)."""
        return self.linear.get_max_length()

    def offload(self) -> None:
        """The linear state moves as transformers moves it; pages stay where they are."""
        self.linear.offload()

    def prefetch(self) -> None:
        self.linear.prefetch()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise LayerCallError(
            f"layer {self.layer_idx}'s K/V rows are its group's, shared with the other members: move rows with the "
            f"VKVCache's method (cache.reorder_cache, crop, reset, ...), which moves the group once and this "
            f"layer's linear state once"
        )

    reorder_cache = batch_select_indices = batch_repeat_interleave = crop = reset = activate_past_recording = _refuse

    def twin(self, group: LayerGroup) -> Any:
        """The layer over ``group`` (a fork of its own) with a linear state of its own: the states
        are written in place, so a fork must not share them."""
        other = VKVLayer.twin(self, group)  # type: ignore[arg-type]
        other.linear = copy.deepcopy(self.linear)
        return other

    def __repr__(self) -> str:
        return f"{type(self).__name__}(layer={self.layer_idx}, group={self.group.name!r})"


class VKVHybridLayer(_HybridParts, VKVLayer, LinearAttentionAndFullAttentionLayer):  # type: ignore[misc]
    """A ``"hybrid"`` layer: linear state in :attr:`linear`, full-attention K/V ``[B, H, S, D]`` in its group."""

    def __init__(self, group: LayerGroup, layer_idx: int, *, number_of_states: int = 1) -> None:
        self._init_parts(group, layer_idx, number_of_states)


class VKVHybridSlidingLayer(  # type: ignore[misc]
        _HybridParts, VKVSlidingLayer, LinearAttentionAndSlidingWindowAttentionLayer):
    """A ``"hybrid_sliding"`` layer: linear state in :attr:`linear`, a sliding window of K/V in its group."""

    def __init__(self, group: LayerGroup, layer_idx: int, *, sliding_window: int, number_of_states: int = 1) -> None:
        self.sliding_window = sliding_window
        self._init_parts(group, layer_idx, number_of_states)


def make_vkv_layer(kind: str, group: LayerGroup, layer_idx: int, kwargs: dict[str, Any]) -> VKVLayer:
    """The layer object of a layer of type ``kind`` whose K/V ``group`` holds (``kwargs``: what
    ``get_layer_types_and_kwargs`` gives for it)."""
    window = group.sliding_window
    if kind in HYBRID_KINDS:
        states = kwargs.get("number_of_states", 1)
        if window is not None:
            return VKVHybridSlidingLayer(group, layer_idx, sliding_window=window, number_of_states=states)
        return VKVHybridLayer(group, layer_idx, number_of_states=states)
    if window is not None:
        return VKVSlidingLayer(group, layer_idx, sliding_window=window)
    return VKVLayer(group, layer_idx)


def cuts_back_unrecorded(layer: Any) -> bool:
    """Whether a layer transformers keeps (:func:`transformers_part`) can be cut back to fewer
    tokens with nothing recorded before: not a sliding window, and no recurrent state, which folds
    every past token in (from transformers 5.25 such a layer says it is croppable, meaning while
    it records its past states, which a fork cannot have done)."""
    if getattr(layer, "is_sliding", False) or not getattr(layer, "is_croppable", True):
        return False
    return not any(getattr(layer, "is_recurrent_states_initialized", {}).values())


def transformers_part(layer: Any) -> Any | None:
    """What of ``layer`` transformers' own code keeps (and the cache's row operations must reach
    besides its groups): the whole layer for transformers' classes, the linear state of a hybrid
    layer, nothing of a :class:`VKVLayer`."""
    if isinstance(layer, _HybridParts):
        return layer.linear
    if isinstance(layer, VKVLayer):
        return None
    return layer

