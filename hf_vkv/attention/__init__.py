"""Paged attention: the ``"vkv_paged"`` attention implementation and its kernels."""
