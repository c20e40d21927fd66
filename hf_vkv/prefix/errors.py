"""Errors of the prefix store and of prefix files (bad input tier, see ``hf_vkv/memory/errors.py``)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..memory.errors import ArgumentError, ArgumentTypeError, VKVError

__all__ = [
    "PrefixFileError", "PrefixFileCorruptError", "PrefixFormatError", "PrefixMismatchError",
    "PrefixPathError", "PrefixNotFoundError", "PrefixIsAFolderError", "PrefixNotAFolderError", "path_argument",
]


class PrefixFileError(VKVError, ValueError):
    """A prefix file cannot be used as it is: the family of the two errors below."""


class PrefixFileCorruptError(PrefixFileError):
    """The prefix file is not whole: truncated or cut short, its safetensors header damaged, or
    its content (a tensor's bytes, the token ids, the metadata) no longer matching its checksums,
    e.g. a flipped bit. Its message says "not whole"."""


class PrefixFormatError(PrefixFileError):
    """The file is not an hf_vkv prefix this version reads: not safetensors at all (a text file,
    another format), safetensors without hf_vkv metadata, an unknown format version or layout,
    metadata with missing or wrong-typed keys, tensors that contradict the metadata, token ids
    outside the model's vocabulary. A file that is no prefix at all is refused as "not an hf_vkv
    prefix"."""


class PrefixMismatchError(VKVError, ValueError):
    """A saved or stored prefix does not belong to the model (or dtype) it is used with.

    ``field`` names what differs: ``"config"`` (a different architecture or size), ``"weights"``
    (same architecture, other weights), ``"dtype"`` (K/V saved in another dtype), ``"token_ids"``
    (ids given to :meth:`~hf_vkv.PrefixStore.insert` outside the model's vocabulary).
    """

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        super().__init__(message)


class PrefixPathError(VKVError, OSError):
    """A path given to a prefix call names nothing there, or the wrong kind of thing (a folder
    where a prefix file goes, a file where a folder goes): the family of the three errors below,
    each also the ``OSError`` subclass Python raises for it. Raised before anything is read or
    written; the message names the path and what goes there."""


class PrefixNotFoundError(PrefixPathError, FileNotFoundError):
    """Nothing is at the path given to :func:`~hf_vkv.load_prefix` or
    :meth:`~hf_vkv.PrefixStore.load`."""


class PrefixIsAFolderError(PrefixPathError, IsADirectoryError):
    """A folder where a prefix file goes (:func:`~hf_vkv.load_prefix`, :func:`~hf_vkv.save_prefix`):
    a folder :meth:`~hf_vkv.PrefixStore.save` wrote is read by :meth:`~hf_vkv.PrefixStore.load`."""


class PrefixNotAFolderError(PrefixPathError, FileExistsError):
    """A file where :meth:`~hf_vkv.PrefixStore.save` writes its folder (the path, or a folder
    above it); ``FileExistsError``, as the ``mkdir`` it replaces raised."""


def path_argument(path: Any, doing: str) -> Path:
    """``path`` (a ``str`` or ``os.PathLike``) as a :class:`~pathlib.Path`; anything else (``None``, an
    int, bytes) is :class:`~hf_vkv.ArgumentTypeError` naming ``doing``, an empty path (``Path("")``
    is the current folder: an unset variable, more likely) :class:`~hf_vkv.ArgumentError`."""
    if not isinstance(path, (str, os.PathLike)):
        raise ArgumentTypeError(f"{doing} takes a path (a str or pathlib.Path), got {type(path).__name__} {path!r:.60}")
    if not os.fspath(path):
        raise ArgumentError(f"{doing} takes a path, got an empty one (which would name the current folder): pass "
                            f"the path, '.' for the current folder")
    return Path(path)
