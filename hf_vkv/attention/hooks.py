"""Refuse ``"vkv_paged"`` and ``"vkv_cascade"`` when a model is built or switched, not at its first forward.

Two methods of ``PreTrainedModel`` are wrapped with these functions by
:func:`hf_vkv.generate.register` (the one place that patches transformers):

* ``get_correct_attn_implementation`` (:func:`check_requested_attention`): transformers' validation
  of an attention name, called by ``PreTrainedModel.__init__`` (so by ``from_pretrained(...,
  attn_implementation=...)`` and ``Model(config)``) and by ``set_attn_implementation`` for the model
  and each sub-model (the same on transformers 5.17 and 5.23);
* ``set_attn_implementation`` (:func:`check_switched_attention`): for a model whose attention does
  not use the attention interface, transformers only logs a warning and keeps the old attention;
  here every sub-model is checked first, so such a model raises instead.

Both raise :class:`~hf_vkv.attention.errors.UnsupportedModelError` (see
:func:`~hf_vkv.attention.support.attention_refusal`) for ``"vkv_paged"`` and ``"vkv_cascade"``
and change nothing else.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from ..kv_records import CASCADE_ATTENTION, PAGED_ATTENTION
from .support import check_attention_support

#: vkv's attentions that a model's own attention code would never call.
_CHECKED = (PAGED_ATTENTION, CASCADE_ATTENTION)

__all__ = ["check_requested_attention", "check_switched_attention"]


def check_requested_attention(original: Callable[..., str], model: PreTrainedModel, requested_attention: str | None,
                              *args: Any, **kwargs: Any) -> str:
    """``get_correct_attn_implementation``, refusing ``"vkv_paged"`` / ``"vkv_cascade"`` for a model it cannot serve."""
    if requested_attention in _CHECKED:
        check_attention_support(type(model), model.config, requested_attention)
    return original(model, requested_attention, *args, **kwargs)


def check_switched_attention(original: Callable[..., Any], model: PreTrainedModel, attn_implementation: str | dict,
                             *args: Any, **kwargs: Any) -> Any:
    """``set_attn_implementation``, checking every model that a ``"vkv_paged"`` / ``"vkv_cascade"`` request
    reaches first."""
    top = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
    if top in _CHECKED:
        # a string reaches every sub-model; a dict's "" entry reaches the model itself
        models = model.modules() if isinstance(attn_implementation, str) else [model]
        for sub in models:
            if isinstance(sub, PreTrainedModel):
                check_attention_support(type(sub), sub.config, top)
    return original(model, attn_implementation, *args, **kwargs)
