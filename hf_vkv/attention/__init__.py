"""Paged attention: the ``"vkv_paged"`` attention implementation, its kernels, and the checks that
refuse (with :class:`UnsupportedModelError`) the models it cannot serve exactly."""

from .errors import UnsupportedModelError
from .paged import register_attention, vkv_paged_attention
from .paged_kv import PAGED_ATTENTION, PAGED_TAG, PagedKV, paged_kv_of
from .support import paged_refusal

__all__ = [
    "PAGED_ATTENTION", "PAGED_TAG", "PagedKV", "UnsupportedModelError", "paged_kv_of", "paged_refusal",
    "register_attention", "vkv_paged_attention",
]
