"""Forwards with autograd on: what a vkv layer's ``update`` returns, and what it refuses.

A vkv cache keeps tokens as *data in pages*, as ``StaticCache`` keeps them in its buffers: the
pages hold values, never autograd history. So in a forward with gradients on (no
``torch.no_grad``, parameters requiring grad, ``model.train()`` with ``labels``):

* the tokens of *that* forward carry their history: ``update`` stores a detached copy in the
  pages and returns ``torch.cat([cached tokens, new states], dim=-2)``, the tensor
  ``DynamicLayer.update`` returns, value for value and stride for stride, so logits and the
  gradients of that forward's loss are exactly ``DynamicCache``'s;
* tokens cached by an *earlier* forward are data: no gradient flows from a later forward back
  into the forward that computed them (with ``DynamicCache`` it would, while that graph lives).

Where that would silently drop a gradient a caller visibly asked for, :class:`VKVGradientError`
is raised instead: states that are leaf tensors requiring grad (a trainable prefix written with
``cache.update``) and states requiring grad given to ``write_states`` (stored with no attention
run, so their history would go nowhere). The static layout's compiled branch (in-place
``index_copy_``) refuses gradients too; a ``torch.compile``d forward with gradients on was seen to
run the eager branch instead (``backend="eager"``, CPU), which returns them as described above.
"""

from __future__ import annotations

import torch

from ..memory import VKVError

__all__ = ["VKVGradientError", "tracks_grad", "refuse_trainable_states", "with_new_states"]

_USE_INSTEAD = ("keep trainable key/value states in a transformers DynamicCache (it keeps autograd history), "
                "or pass .detach()ed states to store them as data")


class VKVGradientError(VKVError, RuntimeError):
    """vkv cannot give the gradient this call asks for: cached tokens are data in pages, not
    autograd history (see :mod:`hf_vkv.cache.grad`). The message says what to use instead."""


def tracks_grad(key_states: torch.Tensor, value_states: torch.Tensor) -> bool:
    """Whether autograd records this ``update``: gradients on and states requiring grad."""
    return torch.is_grad_enabled() and (key_states.requires_grad or value_states.requires_grad)


def refuse_trainable_states(key_states: torch.Tensor, value_states: torch.Tensor, *, layer_idx: int,
                            stored_only: bool = False) -> None:
    """Raise :class:`VKVGradientError` for states whose gradient the cache would drop.

    ``stored_only``: the states are only stored (``write_states``), so any history is lost; else
    (``update``) only leaf states requiring grad are refused — a trainable prefix, whose
    gradient later forwards would need from the pages. States a model computes are not leaves.
    """
    if not torch.is_grad_enabled():
        return
    for name, states in (("key", key_states), ("value", value_states)):
        if states.requires_grad and (stored_only or states.is_leaf):
            what = "stored with no attention run" if stored_only else "a leaf tensor (a trainable prefix?)"
            raise VKVGradientError(
                f"layer {layer_idx}: the {name} states require grad and are {what}; a vkv cache keeps tokens as data "
                f"in pages, so no later forward could give their gradient: {_USE_INSTEAD}"
            )


def with_new_states(keys: torch.Tensor, values: torch.Tensor, key_states: torch.Tensor,
                    value_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What a tracked ``update`` returns: the cached part of ``keys``/``values`` (as the layer
    returned them after storing detached states: ``[B, H, kv_length, D]`` plain tensors whose last
    ``q`` tokens are the new ones) followed by
    ``key_states``/``value_states`` (``[B, H, q, D]``, with history): new contiguous
    ``[B, H, kv_length, D]`` tensors, equal to ``DynamicLayer.update``'s ``torch.cat``."""
    q = key_states.shape[-2]
    past = keys.shape[-2] - q
    return (torch.cat([keys.narrow(-2, 0, past), key_states], dim=-2),
            torch.cat([values.narrow(-2, 0, past), value_states], dim=-2))
