"""Paged attention: the ``"vkv_paged"`` attention implementation and its kernels."""

from .paged import register_attention, vkv_paged_attention
from .paged_kv import PAGED_ATTENTION, PAGED_TAG, PagedKV, paged_kv_of

__all__ = ["PAGED_ATTENTION", "PAGED_TAG", "PagedKV", "paged_kv_of", "register_attention", "vkv_paged_attention"]
