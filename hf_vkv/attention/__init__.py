"""vkv's attention implementations: ``"vkv_paged"`` (block tables, its kernels, and the checks that
refuse, with :class:`UnsupportedModelError`, the models it cannot serve exactly) and
``"vkv_cascade"`` (shared prefixes read once per decode step)."""

from .cascade import CASCADE_ATTENTION, vkv_cascade_attention
from .errors import UnsupportedModelError
from .paged import register_attention, vkv_paged_attention
from .paged_kv import PAGED_ATTENTION, KV_TAG, PagedKV, paged_kv_of
from .support import paged_refusal

__all__ = [
    "CASCADE_ATTENTION", "vkv_cascade_attention", "PAGED_ATTENTION", "KV_TAG", "PagedKV", "UnsupportedModelError", "paged_kv_of", "paged_refusal",
    "register_attention", "vkv_paged_attention",
]
