"""Paged attention: the ``"vkv_paged"`` attention implementation, its kernels, and the checks that
refuse (with :class:`UnsupportedModelError`) the models it cannot serve exactly."""

from .errors import UnsupportedModelError
from .paged import register_attention
from .support import paged_refusal

__all__ = ["UnsupportedModelError", "paged_refusal", "register_attention"]
