"""Prefix reuse across ``generate()`` calls: a radix-tree store of finished prompts' KV pages
(:class:`PrefixStore`) and prefix files (:func:`save_prefix` / :func:`load_prefix`)."""

from .errors import PrefixFileCorruptError, PrefixFileError, PrefixFormatError, PrefixMismatchError
from .persist import load_prefix, save_prefix
from .radix import RadixTree
from .store import PrefixStats, PrefixStore

__all__ = [
    "PrefixFileCorruptError", "PrefixFileError", "PrefixFormatError", "PrefixMismatchError", "PrefixStats",
    "PrefixStore", "RadixTree", "load_prefix", "save_prefix",
]
