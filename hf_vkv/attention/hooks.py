"""Refuse ``"vkv_paged"`` when a model is built or switched, not at its first forward.

Two methods of ``PreTrainedModel`` are wrapped (idempotently, by :func:`install_model_hooks`):

* ``get_correct_attn_implementation``: transformers' validation of an attention name, called by
  ``PreTrainedModel.__init__`` (so by ``from_pretrained(..., attn_implementation=...)`` and
  ``Model(config)``) and by ``set_attn_implementation`` for the model and each sub-model (the same
  on transformers 5.17 and 5.23);
* ``set_attn_implementation``: for a model whose attention does not use the attention interface,
  transformers only logs a warning and keeps the old attention; here every sub-model is checked
  first, so such a model raises instead.

Both raise :class:`~hf_vkv.attention.errors.UnsupportedModelError` (see
:func:`~hf_vkv.attention.support.paged_refusal`) for ``"vkv_paged"`` and change nothing else.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from transformers import PreTrainedModel

from .support import check_paged_support

__all__ = ["install_model_hooks"]

_MARK = "_hf_vkv_paged_check"


def _wrap(name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(PreTrainedModel, name)
    if getattr(original, _MARK, False):
        return
    wrapped = functools.wraps(original)(make(original))
    setattr(wrapped, _MARK, True)
    setattr(PreTrainedModel, name, wrapped)


def install_model_hooks(attention_name: str) -> None:
    """Check every request for ``attention_name`` against the model (idempotent)."""

    def correct(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: PreTrainedModel, requested_attention: str | None, *args: Any, **kwargs: Any) -> str:
            if requested_attention == attention_name:
                check_paged_support(type(self), self.config)
            return original(self, requested_attention, *args, **kwargs)

        return method

    def switch(original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: PreTrainedModel, attn_implementation: str | dict, *args: Any, **kwargs: Any) -> Any:
            top = attn_implementation.get("") if isinstance(attn_implementation, dict) else attn_implementation
            if top == attention_name:
                # a string reaches every sub-model; a dict's "" entry reaches the model itself
                models = self.modules() if isinstance(attn_implementation, str) else [self]
                for sub in models:
                    if isinstance(sub, PreTrainedModel):
                        check_paged_support(type(sub), sub.config)
            return original(self, attn_implementation, *args, **kwargs)

        return method

    _wrap("get_correct_attn_implementation", correct)
    _wrap("set_attn_implementation", switch)
