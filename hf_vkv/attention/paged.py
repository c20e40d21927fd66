"""The ``"vkv_paged"`` attention implementation: reads a paged :class:`~hf_vkv.VKVCache` through
its block tables.

``model.set_attn_implementation("vkv_paged")`` (or ``from_pretrained(...,
attn_implementation="vkv_paged")``) makes the model call :func:`vkv_paged_attention`, and
``VKVCache`` then picks its paged layout by itself. By default the paged layer's ``update`` returns
the layer's tokens gathered through the block tables (what ``DynamicCache`` returns), and this
function runs transformers' own sdpa attention on them: tokens and logits identical to
``DynamicCache`` + ``"sdpa"``, whatever the model does with its keys and values after the update.
With ``cache_config={"paged_kernel": "fused"}`` the layer returns the new states with a
:class:`~hf_vkv.kv_records.PagedKV` tag on the key and value (see :mod:`hf_vkv.kv_records` for why a
tag rather than a forward kwarg), and this function reads the cached tokens through the tag:

* on CUDA it runs the paged kernel (:func:`hf_vkv.attention.kernels.paged_attention`: flash-attn's
  paged path when installed and the block size allows, else Triton), which reads the blocks in
  place;
* on CPU, and wherever exact equality with sdpa is the point (dropout, ``output_attentions``,
  non-causal modules), it gathers the layer's tokens out of the blocks (one index per tensor) and
  runs sdpa on them;
* a call whose key or value alone the model replaced after the update is refused
  (:mod:`hf_vkv.attention.guards`); a model that replaces both leaves no tag to tell by, so each
  call marks the record it got (:class:`~hf_vkv.kv_records.Receipt`) and the layer refuses to go
  on at its next update when its last record reached no attention call (the one such attention
  known, multi-head latent attention, is refused when the fused cache is made).

Untagged key/value (any other cache, or a contiguous ``VKVCache``) are plain tensors: they go to
sdpa as they are. The mask function registered for ``"vkv_paged"`` is transformers' ``sdpa_mask``
(bool ``[B, 1, q, kv]`` or ``None``), without which padding would be silently dropped.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from ..kv_records import CASCADE_ATTENTION, PAGED_ATTENTION, PagedKV, paged_kv_of, record_of
from .cascade import vkv_cascade_attention
from .guards import check_call
from .kernels import gather_kv, paged_attention

__all__ = ["vkv_paged_attention", "reads_in_place", "register_attention", "PAGED_ATTENTION"]


def vkv_paged_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Attention over a paged cache layer (or plain K/V); the transformers attention contract.

    Args:
        query: ``[B, Hq, q, D]``.
        key, value: ``[B, Hkv, kv, D]`` plain tensors (any cache, the paged layout's gathered
            tokens included), or the new ``[B, Hkv, q, D]`` states tagged by a paged cache layer
            of the fused kernel (whose cached tokens are then read through block tables).
        attention_mask: ``sdpa_mask``'s bool ``[B, 1, q, kv]`` (True = attend) or ``None`` (causal).
    Returns:
        ``([B, q, Hq, D], None)`` like transformers' sdpa attention.
    Raises:
        UnsupportedModelError: the call needs what this attention does not compute (sinks,
            softcapping, a position bias sized by the returned keys; see :mod:`.guards`).
    """
    tag: PagedKV | None = paged_kv_of(key)
    value_tag = record_of(value, PagedKV)  # a paged layer tags both: a lone tag means the model replaced the other
    for record in (tag, value_tag):
        if record is not None:
            record.receipt.read = True  # the layer's next update checks that its record reached an attention call
    check_call(module, key, attention_mask, None if tag is None else tag.kv_len, kwargs,
               values_replaced=tag is not None and value_tag is not tag,
               keys_replaced=tag is None and value_tag is not None)
    if tag is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if not reads_in_place(query.device.type, tag, module, dropout=dropout, **kwargs):
        k, v = gather_kv(tag)
        return sdpa_attention_forward(module, query, k, v, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = paged_attention(query, tag, scale=scale, mask=attention_mask)  # [B, Hq, q, D]
    return out.transpose(1, 2).contiguous(), None


def reads_in_place(device_type: str, tag: PagedKV, module: torch.nn.Module, *, dropout: float = 0.0,
                   **kwargs: Any) -> bool:
    """Whether a call runs the fused paged kernel, reading the blocks in place: on CUDA, when the
    cache asked for it (``cache_config={"paged_kernel": "fused"}``, ``tag.fused``) and the call needs
    nothing that only sdpa computes (dropout, attention weights, a non-causal module, a position
    bias). Otherwise the attention gathers the tokens and runs sdpa: DynamicCache's logits exactly."""
    return (tag.fused and device_type == "cuda" and not dropout and not kwargs.get("output_attentions")
            and kwargs.get("is_causal", getattr(module, "is_causal", True)) is not False
            and kwargs.get("position_bias") is None)


def register_attention() -> None:
    """Register ``"vkv_paged"`` and ``"vkv_cascade"`` (:mod:`hf_vkv.attention.cascade`) and their
    mask function (sdpa's) with transformers' attention interfaces (idempotent). The checks that
    refuse models the paged attention cannot serve (:mod:`hf_vkv.attention.hooks`) are installed
    with the other patches by :func:`hf_vkv.generate.register`. The cascade attention reads
    ordinary tensors, so a model whose attention code is its own simply keeps computing it exactly."""
    for name, function in ((PAGED_ATTENTION, vkv_paged_attention), (CASCADE_ATTENTION, vkv_cascade_attention)):
        if AttentionInterface._global_mapping.get(name) is not function:
            AttentionInterface.register(name, function)
        if AttentionMaskInterface._global_mapping.get(name) is not sdpa_mask:
            AttentionMaskInterface.register(name, sdpa_mask)
