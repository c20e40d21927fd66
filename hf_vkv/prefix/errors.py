"""Errors of the prefix store and of prefix files (bad input tier, see ``hf_vkv/memory/errors.py``)."""

from __future__ import annotations

from ..memory.errors import VKVError

__all__ = ["PrefixFileError", "PrefixFileCorruptError", "PrefixFormatError", "PrefixMismatchError"]


class PrefixFileError(VKVError, ValueError):
    """A prefix file cannot be used as it is: the family of the two errors below."""


class PrefixFileCorruptError(PrefixFileError):
    """The file is not a whole safetensors file (truncated, cut short, or not safetensors at all)."""


class PrefixFormatError(PrefixFileError):
    """The file is valid safetensors but not an hf_vkv prefix this version reads (no or broken
    metadata, an unknown format version or layout, tensors that contradict the metadata)."""


class PrefixMismatchError(VKVError, ValueError):
    """A saved or stored prefix does not belong to the model (or dtype) it is used with.

    ``field`` names what differs: ``"config"`` (a different architecture or size), ``"weights"``
    (same architecture, other weights), ``"dtype"`` (K/V saved in another dtype).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)
