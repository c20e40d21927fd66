"""vkv's attention implementations: ``"vkv_paged"`` (block tables, its kernels, and the checks that
refuse, with :class:`UnsupportedModelError`, the models it cannot serve exactly) and
``"vkv_cascade"`` (shared prefixes read once per decode step)."""

from ..kv_records import CASCADE_ATTENTION, KV_TAG, PAGED_ATTENTION, PagedKV, paged_kv_of
from .cascade import vkv_cascade_attention
from .errors import UnsupportedModelError
from .paged import register_attention, vkv_paged_attention
from .support import attention_refusal

__all__ = [
    "CASCADE_ATTENTION", "vkv_cascade_attention", "PAGED_ATTENTION", "KV_TAG", "PagedKV", "UnsupportedModelError", "paged_kv_of", "attention_refusal",
    "register_attention", "vkv_paged_attention",
]
