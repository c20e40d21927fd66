"""Checks of one ``"vkv_paged"`` attention call: what reaches it that it cannot honour.

:mod:`hf_vkv.attention.hooks` refuses unsupported models when they are built; these checks catch
what gets past that (``config._attn_implementation`` assigned directly, a model class the source
checks cannot see into) at the first forward, before anything is computed.
"""

from __future__ import annotations

from typing import Any

import torch

from .errors import UnsupportedModelError
from .support import model_type_of

__all__ = ["check_call"]


def check_call(module: torch.nn.Module, key: torch.Tensor, attention_mask: torch.Tensor | None,
               paged_kv_len: int | None, kwargs: dict[str, Any], *, values_replaced: bool = False,
               keys_replaced: bool = False) -> None:
    """Raise :class:`UnsupportedModelError` when this call needs what the paged attention lacks.

    Args:
        module: the attention module that called.
        key: the key it passed (``[B, H, kv, D]``).
        attention_mask: the mask it passed.
        paged_kv_len: tokens the paged tag says attention reads (``None``: the key is untagged).
        kwargs: the call's other keyword arguments.
        values_replaced: the key is tagged but the value is not the tensor the cache's update
            returned with it (the paged attention would read the stored values, not these).
        keys_replaced: the value is tagged but the key is not (the model replaced the key after
            the update: the paged attention would see the new keys alone).
    """
    model_type = model_type_of(getattr(module, "config", None), type(module).__name__)
    if keys_replaced:
        raise UnsupportedModelError(
            model_type=model_type,
            feature="it passes the attention other keys than the cache update returned, so the paged cache's "
                    "record of what to read was lost")
    if values_replaced:
        raise UnsupportedModelError(
            model_type=model_type,
            feature="it passes the attention other values than the cache update returned (differential attention "
                    "splits them), and the paged attention reads the values the cache stored")
    if kwargs.get("s_aux") is not None:
        raise UnsupportedModelError(model_type=model_type,
                                    feature="attention sinks (s_aux) are not part of the paged attention")
    if kwargs.get("softcap") is not None:
        raise UnsupportedModelError(
            model_type=model_type,
            feature=f"attention logit softcapping (softcap={kwargs['softcap']}) is not part of the paged attention")
    kv_len, tagged = (key.shape[-2], False) if paged_kv_len is None else (paged_kv_len, True)
    bias = kwargs.get("position_bias")
    if bias is not None and _lost_keys(bias.shape[-1], kv_len, tagged=tagged):
        raise UnsupportedModelError(
            model_type=model_type,
            feature=f"its position bias covers {bias.shape[-1]} keys but the cache holds {kv_len}: the bias is "
                    "computed from the length of the keys a paged cache returns, which are only the new ones",
        )
    if attention_mask is not None and _lost_keys(attention_mask.shape[-1], kv_len, tagged=tagged):
        raise UnsupportedModelError(
            model_type=model_type,
            feature=f"its mask covers {attention_mask.shape[-1]} keys but the attention got {kv_len}: the model "
                    "changed the keys between the cache update and the attention call, so the paged cache's "
                    "record of what to read was lost",
        )


def _lost_keys(covered: int, kv_len: int, *, tagged: bool) -> bool:
    """Whether a mask or position bias over ``covered`` keys says the attention got other keys than
    the ``kv_len`` the cache holds. Tagged keys (the fused kernel reads the tag's tokens): any other
    length. Plain keys (any cache, the paged layout's gathered tokens) go to sdpa as DynamicCache's
    would, so one shorter is sdpa's to broadcast as there (transformers 5.20's RecurrentGemma passes
    a ``[B, 1, 1, 1]`` decode mask); one longer means cached keys are missing (a fused cache's key
    and value both replaced after the update)."""
    return covered != kv_len if tagged else covered > kv_len
