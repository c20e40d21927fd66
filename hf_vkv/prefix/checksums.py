"""Content checks of a prefix file: its metadata's shape and types, and checksums of its content.

A prefix file's ``checksums`` (metadata) hold a BLAKE2b digest of each tensor's bytes
(``"layers.{i}.keys"`` / ``"layers.{i}.values"``), of its token ids (``"token_ids"``) and of the
rest of the metadata (``"metadata"``: every other key, as canonical JSON), so that a flipped bit
anywhere — K/V, ids, fingerprints, layer starts — is refused at load as a file that is not whole
(:class:`PrefixFileCorruptError`), naming what differs. Metadata that lacks a key or has one of
the wrong type is not a prefix this version reads (:class:`PrefixFormatError`).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch

from .errors import PrefixFileCorruptError, PrefixFormatError

__all__ = ["checksums_of", "validate_meta", "verify_checksums"]

_DIGEST_BYTES = 16


def _digest(data: bytes | memoryview) -> str:
    return hashlib.blake2b(data, digest_size=_DIGEST_BYTES).hexdigest()


def tensor_digest(tensor: torch.Tensor) -> str:
    """Digest of a CPU tensor's bytes (its dtype and shape are the header's, checked apart)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return _digest(memoryview(flat.numpy()))


def _meta_digest(meta: dict[str, Any]) -> str:
    rest = {k: v for k, v in meta.items() if k != "checksums"}
    return _digest(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def checksums_of(meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """The ``checksums`` of a file with metadata ``meta`` (without checksums) and ``tensors``."""
    out = {name: tensor_digest(t) for name, t in sorted(tensors.items())}
    out["token_ids"] = _digest(json.dumps(meta["token_ids"]).encode())
    out["metadata"] = _meta_digest(meta)
    return out


def verify_checksums(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Raise :class:`PrefixFileCorruptError` (the file is not whole) naming the first part whose
    checksum differs; :class:`PrefixFormatError` if the checksums do not cover the file's parts."""
    sums = meta["checksums"]
    expected = set(tensors) | {"token_ids", "metadata"}
    if set(sums) != expected:
        raise PrefixFormatError(f"{path}: checksums cover {sorted(set(sums) ^ expected)[:4]} wrongly")
    if sums["metadata"] != _meta_digest(meta):
        raise PrefixFileCorruptError(f"{path} is not whole: the metadata does not match its checksum (the file was "
                                     f"changed or damaged)")
    if sums["token_ids"] != _digest(json.dumps(meta["token_ids"]).encode()):
        raise PrefixFileCorruptError(f"{path} is not whole: the token ids do not match their checksum (the file was "
                                     f"changed or damaged)")
    for name in sorted(tensors):
        if sums[name] != tensor_digest(tensors[name]):
            raise PrefixFileCorruptError(f"{path} is not whole: tensor {name!r} does not match its checksum (the file "
                                         f"was changed or damaged)")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def validate_meta(path: Path, meta: dict[str, Any]) -> None:
    """Raise :class:`PrefixFormatError` naming the key unless every key a load reads is present
    with its type (never a ``TypeError`` / ``AttributeError`` later)."""

    def bad(key: str, want: str) -> PrefixFormatError:
        return PrefixFormatError(f"{path}: metadata {key!r} must be {want}, got {meta.get(key)!r:.80}")

    missing = [k for k in ("dtype", "length", "token_ids", "config_fingerprint", "layers", "checksums")
               if k not in meta]
    if missing:
        raise PrefixFormatError(f"{path}: metadata lacks {missing}")
    if not isinstance(meta["dtype"], str) or not isinstance(getattr(torch, meta["dtype"], None), torch.dtype):
        raise bad("dtype", "a torch dtype name such as 'float32'")
    if not _is_int(meta["length"]) or meta["length"] <= 0:
        raise bad("length", "a positive int")
    ids = meta["token_ids"]
    if not isinstance(ids, list) or not all(_is_int(t) for t in ids):
        raise bad("token_ids", "a list of ints")
    if len(ids) != meta["length"]:
        raise PrefixFormatError(f"{path}: metadata length {meta['length']} does not match its {len(ids)} token ids")
    if not isinstance(meta["config_fingerprint"], str):
        raise bad("config_fingerprint", "a string")
    if not isinstance(meta.get("config_fields", {}), dict):
        raise bad("config_fields", "a dict")
    if not isinstance(meta.get("config_rest", {}), dict):
        raise bad("config_rest", "a dict")
    if not isinstance(meta.get("weights_fingerprint"), (str, type(None))):
        raise bad("weights_fingerprint", "a string or null")
    layers = meta["layers"]
    if not isinstance(layers, list) or not all(
            isinstance(info, dict) and _is_int(info.get("start")) and info["start"] >= 0
            and (info.get("window") is None or _is_int(info["window"])) for info in layers):
        raise bad("layers", "a list of {'start': int >= 0, 'window': int or null}")
    sums = meta["checksums"]
    if not isinstance(sums, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in sums.items()):
        raise bad("checksums", "a dict of strings")
