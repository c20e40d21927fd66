"""Prefix files: one batch-1 cache and its token ids in a safetensors file.

Layout of a file (format version 2, layout ``"contiguous"``):

* tensors ``layers.{i}.keys`` / ``layers.{i}.values``: layer ``i``'s cached K/V, ``[1, kv_heads,
  T_i, head_dim]`` in the cache's dtype. ``T_i`` is the whole prefix for full-attention layers and
  its last ``window - 1`` tokens for sliding-window layers (all they keep);
* metadata key ``"hf_vkv_prefix"``: JSON with ``format``, ``version``, ``layout``, ``dtype``,
  ``length``, ``token_ids``, ``config_fingerprint``, ``config_fields`` and ``config_rest`` (what was
  hashed, to say what differs: :func:`~hf_vkv.prefix.fingerprint.config_record`), ``weights_fingerprint`` (when saved with the model), per layer its
  ``start`` (the position of its first saved token) and ``window``, and ``checksums``: a digest
  of every tensor's bytes, of the token ids and of the rest of the metadata
  (:mod:`.checksums`), so a file is verified by content at load, not only by shape.

Loading checks, before it builds anything: the metadata's every key and type, each checksum
(naming the tensor, the ids or the metadata that differ), the token ids against the model's
vocabulary, and the weights fingerprint (a file without one is refused unless
``check_weights=False``). Every refusal is a :class:`PrefixFileError` or
:class:`PrefixMismatchError`; nothing is left half-loaded. Of the file errors,
:class:`PrefixFileCorruptError` is a file that is not whole (truncated, a damaged header, content
that differs from its checksums: a flipped bit) and :class:`PrefixFormatError` one that is not an
hf_vkv prefix this version reads (not safetensors, e.g. a text file; no prefix metadata; another
format version or layout; malformed metadata).

Loading rebuilds a :class:`~hf_vkv.VKVCache` with :meth:`~hf_vkv.VKVCache.write_states`: a
sliding layer holds its saved window only (tokens ``[start, length)``), so the rebuilt cache
continues a generation exactly and is never cut back below ``start + window - 1``
(:meth:`~hf_vkv.VKVCache.min_prefix_length`).
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..cache import VKVCache
from ..memory.errors import ArgumentError, ArgumentTypeError
from ..version import __version__
from .errors import (
    PrefixFileCorruptError,
    PrefixFormatError,
    PrefixIsAFolderError,
    PrefixMismatchError,
    PrefixNotFoundError,
    path_argument,
)
from .checksums import checksums_of, verify_checksums, validate_meta
from .fingerprint import (WEIGHTS_DIFFER, config_difference, config_fingerprint, config_record, weights_fingerprint,
                          weights_match)
from .tokens import check_unpadded, outside_vocabulary, token_list

__all__ = ["save_prefix", "load_prefix", "FORMAT", "VERSION", "LAYOUT"]

FORMAT = "hf_vkv.prefix"
VERSION = 2  # 2: content checksums (files of version 1 are refused: save them again)
LAYOUT = "contiguous"
_META_KEY = "hf_vkv_prefix"
_MAX_HEADER = 100_000_000  # safetensors' own bound on a header's bytes


def save_prefix(path: str | os.PathLike[str], cache: VKVCache, token_ids: Any, *,
                model: torch.nn.Module | None = None) -> Path:
    """Write a batch-1 ``cache`` and the ids of its tokens (``[T]``, ``[1, T]`` or a list; ``T``
    must equal ``cache.get_seq_length()``) to ``path`` (written to a temporary name, then renamed).

    With ``model``, a fingerprint of its weights is stored too, and :func:`load_prefix` given a
    model rejects one with other weights. Returns the path.
    """
    return _save(path, cache, token_ids, model=model, weights=None if model is None else weights_fingerprint(model))


def _save(path: str | os.PathLike[str], cache: VKVCache, token_ids: Any, *, model: torch.nn.Module | None,
          weights: str | None) -> Path:
    """:func:`save_prefix` with the weights fingerprint given (``None``: the file carries none)."""
    tokens = token_list(token_ids)
    if not isinstance(cache, VKVCache):
        raise ArgumentTypeError(f"save_prefix needs a hf_vkv.VKVCache, got {type(cache).__name__}: generate with "
                                f"cache_implementation='vkv' and pass out.past_key_values")
    path = path_argument(path, "save_prefix")
    if path.is_dir():
        raise PrefixIsAFolderError(f"{path} is a folder: save_prefix writes one file, name one inside it (e.g. "
                                   f"{path / 'prefix.safetensors'}); a whole store goes to a folder by PrefixStore.save")
    if not path.parent.is_dir():
        raise PrefixNotFoundError(f"save_prefix writes {path} into the folder {path.parent}, which does not exist: "
                                  f"create it first")
    kept = len(cache.transformers_layers())
    if kept:
        raise ArgumentError(f"save_prefix saves key/value states only, and {kept} layer(s) of this cache keep "
                            f"recurrent or linear-attention state in transformers' classes: a file without it would "
                            f"continue the generation wrongly; keep such prefixes in memory (PrefixStore, cache.fork())")
    n = cache.get_seq_length()
    if cache.rows != 1:
        raise ArgumentError(f"save_prefix saves batch-1 caches, this one holds {cache.rows} rows; keep one row first "
                            f"(cache.batch_select_indices(torch.tensor([row])) on a fork)")
    if len(tokens) != n or n == 0:
        raise ArgumentError(f"token_ids has {len(tokens)} ids but the cache holds {n} tokens; pass the ids of "
                         f"the cached positions: out.sequences[0, :cache.get_seq_length()]")
    check_unpadded(cache, "save_prefix")
    if model is not None and config_fingerprint(model.config) != config_fingerprint(cache.config):
        raise PrefixMismatchError("config", "the cache was not made by this model (config fingerprints differ)")
    tensors: dict[str, torch.Tensor] = {}
    layers: list[dict[str, Any]] = []
    dtype: torch.dtype | None = None
    for i, layer in enumerate(cache.layers):
        keys, values = layer.keys, layer.values
        if (keys is None or values is None) and i in VKVCache.cross_attention_layers(cache.config):
            # a cross-attention layer of a text-only call holds nothing (an earlier reader refuses the file: a layer
            # "starting" at token n that does not slide)
            layers.append({"start": n, "window": None, "empty": True})  # its tensors: [1, 0, 0, 0], below
            continue
        if keys is None or values is None:
            raise ArgumentError(f"layer {i} of the cache holds no states: nothing to save; save the cache after "
                                f"generate (or a forward) filled it")
        dtype = dtype or keys.dtype
        tensors[f"layers.{i}.keys"] = keys.detach().to("cpu").contiguous()
        tensors[f"layers.{i}.values"] = values.detach().to("cpu").contiguous()
        layers.append({"start": n - keys.shape[2], "window": getattr(layer, "sliding_window", None)})
    assert dtype is not None
    for i, info in enumerate(layers):
        if info.get("empty"):
            tensors[f"layers.{i}.keys"] = torch.zeros(1, 0, 0, 0, dtype=dtype)
            tensors[f"layers.{i}.values"] = torch.zeros(1, 0, 0, 0, dtype=dtype)
    meta = {
        "format": FORMAT, "version": VERSION, "layout": LAYOUT, "writer": f"hf_vkv {__version__}",
        "dtype": str(dtype).removeprefix("torch."), "length": n, "token_ids": tokens,
        **config_record(cache.config), "weights_fingerprint": weights, "layers": layers,
    }
    meta["checksums"] = checksums_of(meta, tensors)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{threading.get_ident()}")
    try:
        save_file(tensors, str(tmp), metadata={_META_KEY: json.dumps(meta)})
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def load_prefix(
    path: str | os.PathLike[str], *, model: torch.nn.Module | None = None, config: Any = None,
    dtype: torch.dtype | None = None, device: str | torch.device = "cpu", cache_config: dict[str, Any] | None = None,
    check_weights: bool = True, memory_of: VKVCache | None = None,
) -> tuple[VKVCache, list[int]]:
    """Read a prefix file into a new :class:`~hf_vkv.VKVCache` on ``device``; return it and its token ids.

    Give the ``model`` it is for (config, dtype and, if saved with one, weights are checked) or
    its ``config`` (and optionally the expected ``dtype``). Continue with
    ``model.generate(ids, past_key_values=cache)`` where ``ids`` starts with the token ids and has
    at least one more. ``cache_config`` holds :class:`~hf_vkv.CacheOptions` for the new cache.
    ``check_weights=False`` accepts, with a ``model``, a file saved without one (no weights
    fingerprint): an explicit opt-out, since such a file cannot tell other weights apart.
    ``device`` picks the backend as the cache does: host pages on CPU, the CUDA backend on a
    CUDA device (``hf_vkv[cuda]``; not yet run on a GPU), ``UnsupportedDeviceError`` elsewhere.
    ``memory_of``: the new cache draws from that cache's memory (a :class:`PrefixStore` loads
    into its own, see :meth:`PrefixStore.load`).

    Raises:
        PrefixNotFoundError: no file at ``path`` (a ``FileNotFoundError``).
        PrefixIsAFolderError: ``path`` is a folder (an ``IsADirectoryError``): a folder
            :meth:`PrefixStore.save` wrote is read by :meth:`PrefixStore.load`.
        PrefixFileCorruptError: the file is not whole: truncated, its safetensors header damaged,
            or a checksum differs (naming the tensor, the ids or the metadata: a flipped bit).
        PrefixFormatError: it is not an hf_vkv prefix this version reads: not safetensors (a text
            file), no prefix metadata, another format version or layout, malformed metadata, or
            a token id outside the model's vocabulary.
        PrefixMismatchError: it was saved for another model (``field="config"``), other weights
            (``"weights"``; also a file saved without ``model=`` unless ``check_weights=False``)
            or another dtype (``"dtype"``).
    """
    return _load(path, model=model, config=config, dtype=dtype, device=device, cache_config=cache_config,
                 check_weights=check_weights, memory_of=memory_of)


def _load(
    path: str | os.PathLike[str], *, model: torch.nn.Module | None = None, config: Any = None,
    dtype: torch.dtype | None = None, device: str | torch.device = "cpu", cache_config: dict[str, Any] | None = None,
    check_weights: bool = True, memory_of: VKVCache | None = None, weights: str | None = None,
) -> tuple[VKVCache, list[int]]:
    """:func:`load_prefix`; ``weights``: the model's weights fingerprint if already known."""
    if (model is None) == (config is None):
        raise ArgumentTypeError("load_prefix needs exactly one of model=... or config=...: pass the model the file "
                                "is for (or its config)")
    config = model.config if model is not None else config
    path = path_argument(path, "load_prefix")
    if path.is_dir():
        raise PrefixIsAFolderError(f"{path} is a folder, not a prefix file: a folder written by PrefixStore.save(folder) "
                                   f"is read by PrefixStore.load(folder, model=model)")
    if not path.exists():
        raise PrefixNotFoundError(f"no prefix file at {path}: pass the path save_prefix wrote")
    meta, tensors = _read(path)
    _check_model(path, meta, config, model, dtype, check_weights=check_weights, weights=weights)
    n, tokens = meta["length"], meta["token_ids"]
    cache = VKVCache.from_cache_config(config, cache_config, batch_size=1, memory_of=memory_of)
    if len(meta["layers"]) != len(cache.layers):
        raise PrefixFormatError(f"{path} holds {len(meta['layers'])} layers, the model has {len(cache.layers)}")
    try:
        for i, (layer, info) in enumerate(zip(cache.layers, meta["layers"])):
            keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
            start = info["start"]
            if info.get("empty") is True and keys.numel() == 0 and i in VKVCache.cross_attention_layers(cache.config):
                continue  # a cross-attention layer that held nothing: it stays empty
            if start > 0 and (info["window"] is None or getattr(layer, "sliding_window", None) != info["window"]):
                raise PrefixFormatError(f"{path}: layer {i} starts at token {start} but is not sliding")
            cache.write_states(i, keys.to(device), values.to(device), start=start)
    except BaseException:
        cache.close()
        raise
    assert cache.get_seq_length() == n
    return cache, list(tokens)


def _read(path: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The metadata and the tensors of a prefix file, checked against each other."""
    with open(path, "rb") as f:  # PermissionError as it is (_load refuses a missing path and a folder)
        size = os.fstat(f.fileno()).st_size
        head = f.read(9)
        header_len = int.from_bytes(head[:8], "little")
        # safetensors: the header's length (8 bytes, little-endian, at most _MAX_HEADER), then its JSON ("{")
        if any(head[4:8]) or (len(head) == 9 and (header_len > _MAX_HEADER or head[8:9] != b"{")):
            raise PrefixFormatError(f"{path} is not an hf_vkv prefix: it is not a safetensors file (it does not "
                                    f"start with a safetensors header)")
        if len(head) < 9:
            raise PrefixFileCorruptError(f"{path} is not whole (truncated): {size} bytes, too short for a "
                                         f"safetensors file")
        if header_len > size - 8:
            raise PrefixFileCorruptError(f"{path} is not whole (truncated): its header claims {header_len:,} bytes, "
                                         f"the file has {size:,}")
        f.seek(8)
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PrefixFileCorruptError(f"{path} is not whole: its safetensors header is damaged (not JSON: {e})") from None
    meta_raw = (header.pop("__metadata__", None) or {}) if isinstance(header, dict) else None
    try:
        ends = [info["data_offsets"][1] for info in header.values()]  # type: ignore[union-attr]
        malformed = not isinstance(meta_raw, dict) or not all(isinstance(e, int) for e in ends)
    except (TypeError, KeyError, IndexError, AttributeError):
        malformed = True
    if malformed:
        raise PrefixFileCorruptError(f"{path} is not whole: its safetensors header is damaged (malformed)") from None
    described = 8 + header_len + max(ends, default=0)
    if described != size:
        how = "truncated" if size < described else "bytes appended"
        raise PrefixFileCorruptError(f"{path} is not whole ({how}): its header describes {described:,} bytes, "
                                     f"the file has {size:,}")
    if _META_KEY not in meta_raw:
        raise PrefixFormatError(f"{path} is a safetensors file but not an hf_vkv prefix (no {_META_KEY!r} metadata)")
    try:
        meta = json.loads(meta_raw[_META_KEY])
    except (TypeError, json.JSONDecodeError) as e:
        raise PrefixFileCorruptError(f"{path} is not whole: its {_META_KEY!r} metadata is damaged (not JSON: {e})"
                                     ) from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise PrefixFormatError(f"{path} is not an hf_vkv prefix: metadata format is "
                                f"{meta.get('format') if isinstance(meta, dict) else meta!r}, expected {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise PrefixFormatError(f"{path} has prefix format version {meta.get('version')!r}; this hf_vkv reads "
                                f"version {VERSION}: save it again with this version")
    if meta.get("layout") != LAYOUT:
        raise PrefixFormatError(f"{path} has layout {meta.get('layout')!r}; this hf_vkv reads {LAYOUT!r}")
    validate_meta(path, meta)  # every key and type: nothing below meets a malformed value
    try:
        tensors = load_file(str(path))
    except SafetensorError as e:
        raise PrefixFileCorruptError(f"{path} is not whole: it cannot be read as safetensors ({e})") from None
    _check_tensors(path, meta, tensors)
    verify_checksums(path, meta, tensors)
    return meta, tensors


def _check_tensors(path: Path, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    n, tokens, layers = meta["length"], meta["token_ids"], meta["layers"]
    if not (isinstance(n, int) and n > 0 and isinstance(tokens, list) and len(tokens) == n
            and all(isinstance(t, int) for t in tokens)):
        raise PrefixFormatError(f"{path}: metadata length {n!r} does not match its {len(tokens)} token ids")
    expected = {f"layers.{i}.{kv}" for i in range(len(layers)) for kv in ("keys", "values")}
    if set(tensors) != expected:
        raise PrefixFormatError(f"{path}: tensors {sorted(set(tensors) ^ expected)[:4]} are missing or unexpected")
    for i, info in enumerate(layers):
        keys, values = tensors[f"layers.{i}.keys"], tensors[f"layers.{i}.values"]
        start = info.get("start")
        if (keys.shape != values.shape or keys.dim() != 4 or keys.shape[0] != 1 or not isinstance(start, int)
                or keys.shape[2] != n - start or start < 0 or str(keys.dtype).removeprefix("torch.") != meta["dtype"]):
            raise PrefixFormatError(f"{path}: layer {i} holds {tuple(keys.shape)} {keys.dtype} K/V, which does not "
                                    f"match {n} tokens from {start!r} in {meta['dtype']}")


def _check_model(path: Path, meta: dict[str, Any], config: Any, model: torch.nn.Module | None,
                 dtype: torch.dtype | None, *, check_weights: bool = True, weights: str | None = None,
                 config_known: dict[str, Any] | None = None) -> None:
    """Refuse ``meta`` (a file's) unless it is ``config``'s (:func:`config_difference`;
    ``config_known``: its :func:`config_record`, if known), ``model``'s dtype and weights, and its
    token ids are in the vocabulary."""
    detail = config_difference(meta, config_known or config_record(config))
    if detail is not None:
        raise PrefixMismatchError("config", f"{path} was saved for another model ({detail})")
    if dtype is None and model is not None:
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None and str(dtype).removeprefix("torch.") != meta["dtype"]:
        raise PrefixMismatchError("dtype", f"{path} holds {meta['dtype']} K/V but the model runs in "
                                  f"{str(dtype).removeprefix('torch.')}; save the prefix again from a model in that "
                                  f"dtype (converted K/V would not give the same tokens)")
    bad = outside_vocabulary(meta["token_ids"], config)
    if bad is not None:
        raise PrefixFormatError(f"{path}: token id {bad[1]} at position {bad[0]} is outside the model's "
                                f"vocabulary of {bad[2]} ids")
    saved_weights = meta.get("weights_fingerprint")
    if model is not None and saved_weights is None and check_weights:
        again = "store.save(folder, model=model)" if path.is_dir() else "save_prefix(..., model=model)"
        raise PrefixMismatchError("weights", f"{path} was saved without a weights fingerprint, so it cannot be checked "
                                  f"against this model's weights: save it again with {again}, or pass "
                                  f"check_weights=False to load it unchecked")
    if model is not None and saved_weights is not None and not weights_match(saved_weights, model, weights):
        raise PrefixMismatchError("weights", f"{path} was saved for a model of the same architecture with other "
                                  f"weights ({WEIGHTS_DIFFER})")
