"""The paged attention interface the kernels share, and its one check.

The paged layout keeps key/value tokens in a pool of fixed-size blocks; each row (sequence) owns a
block table that lists, in order, the blocks holding its tokens. A kernel reads K/V through that
table instead of through a contiguous tensor.

The interface (shared by :func:`hf_vkv.attention.kernels.paged_attention_reference`,
:func:`hf_vkv.attention.kernels.paged_attention` and
:func:`hf_vkv.attention.triton_paged.paged_attention_triton`, all called
``kernel(query, kv, *, scale, mask=None)`` with ``kv`` a :class:`~hf_vkv.kv_records.PagedKV`):

* ``key_cache``, ``value_cache``: ``[num_blocks, block_size, kv_heads, head_dim]``, float32,
  float16 or bfloat16, any strides with ``stride(-1) == 1`` (the cache hands strided views of a
  token-major store whose block and token strides span every layer of a group);
* ``block_tables``: int32 ``[batch, max_blocks]``; entry ``j`` of row ``b`` is the block holding the
  row's absolute token positions ``[j * block_size, (j + 1) * block_size)``. Entries for blocks wholly
  before ``kv_offset`` (dropped behind a sliding window) and entries past a row's length may hold
  anything: they are never read;
* row ``b`` attends to absolute tokens ``[kv_offset, kv_offset + L_b)``, ``L_b = kv_lens[b]`` when
  ``kv_lens`` (int32 ``[batch]``, each ``<= kv_len``) is given, else ``kv_len``;
* ``query``: ``[batch, q_heads, q, head_dim]`` with ``q_heads % kv_heads == 0``; query head ``h``
  reads kv head ``h // (q_heads // kv_heads)`` (GQA/MQA); query token ``i`` of row ``b`` sits at
  absolute position ``kv_offset + L_b - q + i``;
* ``mask``: ``None`` means causal, bottom-right aligned (query ``i`` attends the tokens at positions
  up to its own). Otherwise a bool ``[batch, 1, q, kv_len]`` (True = attend; column ``c`` is absolute
  token ``kv_offset + c``), as transformers' ``sdpa_mask`` makes it, that *replaces* the causal rule
  (it already encodes causality, padding and the sliding window). Columns ``>= L_b`` are never
  attended either way;
* output: ``[batch, q_heads, q, head_dim]`` in the query's dtype. **A query row with nothing to
  attend to returns zeros**, as flash-attn does (``F.scaled_dot_product_attention`` returns NaN
  there in some torch versions and backends; torch 2.13 on the CPU returns zeros; the reference
  zeroes such rows itself either way).

Bad arguments raise ``TypeError``/``ValueError`` naming the argument and the fix. Checks that would
read tensor values (``kv_lens <= kv_len``, block ids inside the pool) run only for CPU tensors: on a
GPU they would cost a host synchronization per layer, and the block tables come from the cache, not
from users.

:func:`paged_kernel` wraps a kernel of this interface with :func:`check_paged_inputs`, so each
public kernel checks its arguments once, and the dispatcher
(:func:`hf_vkv.attention.kernels.paged_attention`) checks them once before it calls the kernel it
picks unchecked (``kernel.__wrapped__``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TypeVar

import torch
from torch import Tensor

from ..kv_records import PagedKV
from ..memory.errors import ArgumentError, ArgumentTypeError

__all__ = ["check_block_ids", "check_caches", "check_paged_inputs", "paged_kernel"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_block_ids(used: Tensor, num_blocks: int) -> None:
    """``used``: the block ids a kernel will read (any shape); each must index the pool."""
    if used.numel():
        low, high = int(used.min()), int(used.max())
        if low < 0 or high >= num_blocks:
            raise ArgumentError(f"block_tables refers to block {low if low < 0 else high} for a token that is read, "
                                f"but the caches hold blocks [0, {num_blocks})")


def check_caches(kv: PagedKV) -> None:
    """The checks :func:`~hf_vkv.attention.kernels.gather_kv` and the kernels share (caches,
    tables, offsets)."""
    key_cache, value_cache, block_tables = kv.caches()
    kv_offset, kv_len = kv.kv_offset, kv.kv_len
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables)):
        if not isinstance(t, Tensor):
            raise ArgumentTypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, value in (("kv_offset", kv_offset), ("kv_len", kv_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ArgumentError(f"{name} must be a non-negative int, got {value!r}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise ArgumentTypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ArgumentError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got shape "
                                f"{tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ArgumentError(f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
                                f"{t.stride()}; pass a view of a store whose head_dim is innermost")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ArgumentError(f"key_cache ({key_cache.dtype} {tuple(key_cache.shape)}) and value_cache "
                            f"({value_cache.dtype} {tuple(value_cache.shape)}) must have the same shape and dtype")
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if block_size < 1 or kv_heads < 1:
        raise ArgumentError(f"key_cache needs block_size >= 1 and kv_heads >= 1, got shape {tuple(key_cache.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ArgumentError(f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} "
                            f"{tuple(block_tables.shape)}")
    if block_tables.shape[1] * block_size < kv_offset + kv_len:
        raise ArgumentError(f"block_tables has {block_tables.shape[1]} blocks of {block_size} tokens a row, fewer "
                            f"than kv_offset + kv_len = {kv_offset + kv_len} tokens; give every row enough entries")
    devices = {t.device for t in (key_cache, value_cache, block_tables)}
    if len(devices) > 1:
        raise ArgumentError(f"key_cache, value_cache and block_tables must be on one device, got "
                            f"{sorted(str(d) for d in devices)}")


def check_paged_inputs(query: Tensor, kv: PagedKV, *, scale: float, mask: Tensor | None = None) -> None:
    """Raise ``TypeError``/``ValueError`` (naming the argument and the fix) unless the arguments
    follow the interface of this module's docstring. Reads tensor values only for CPU tensors."""
    if not isinstance(kv, PagedKV):
        raise ArgumentTypeError(f"kv must be a PagedKV (the caches, block tables, offset and lengths), got {type(kv).__name__}")
    check_caches(kv)
    key_cache, _, block_tables = kv.caches()
    kv_offset, kv_len, kv_lens = kv.kv_offset, kv.kv_len, kv.kv_lens
    if not isinstance(query, Tensor):
        raise ArgumentTypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ArgumentError(f"scale must be a finite float (usually head_dim ** -0.5), got {scale!r}")
    if query.dtype != key_cache.dtype:
        raise ArgumentTypeError(f"query has dtype {query.dtype} but the caches have {key_cache.dtype}; cast the query")
    if query.dim() != 4:
        raise ArgumentError(f"query must be [batch, q_heads, q, head_dim], got shape {tuple(query.shape)}")
    batch, q_heads, q, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ArgumentError(f"query head_dim {head_dim} differs from the caches' head_dim {key_cache.shape[3]}")
    if q_heads % kv_heads:
        raise ArgumentError(f"q_heads ({q_heads}) must be a multiple of the caches' kv_heads ({kv_heads})")
    if block_tables.shape[0] != batch:
        raise ArgumentError(f"block_tables has {block_tables.shape[0]} rows but query has batch {batch}")
    devices = {query.device, key_cache.device}
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise ArgumentTypeError(f"mask must be a bool tensor (True = attend) or None for causal, got "
                                    f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (batch, 1, q, kv_len):
            raise ArgumentError(f"mask must be [batch, 1, q, kv_len] = {[batch, 1, q, kv_len]}, got {list(mask.shape)}")
        devices.add(mask.device)
    if kv_lens is not None:
        if not isinstance(kv_lens, Tensor) or kv_lens.dtype != torch.int32 or tuple(kv_lens.shape) != (batch,):
            raise ArgumentError(f"kv_lens must be int32 [batch={batch}] or None, got "
                                f"{getattr(kv_lens, 'dtype', type(kv_lens).__name__)} "
                                f"{tuple(getattr(kv_lens, 'shape', ()))}")
        devices.add(kv_lens.device)
    if len(devices) > 1:
        raise ArgumentError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if block_tables.device.type != "cpu" or not batch:
        return
    if kv_lens is not None:
        low, high = int(kv_lens.min()), int(kv_lens.max())
        if low < 0 or high > kv_len:
            raise ArgumentError(f"kv_lens must lie in [0, kv_len={kv_len}], got values in [{low}, {high}]")
    block_size = key_cache.shape[1]
    ends = kv_offset + (kv_lens.long() if kv_lens is not None else torch.full((batch,), kv_len))  # [batch]
    starts = torch.arange(block_tables.shape[1]) * block_size  # first position of each entry's block
    read = (starts[None, :] + block_size > kv_offset) & (starts[None, :] < ends[:, None])  # [batch, max_blocks]
    check_block_ids(block_tables[read], key_cache.shape[0])


_K = TypeVar("_K", bound=Callable[..., Tensor])


def paged_kernel(kernel: _K) -> _K:
    """``kernel`` (a function of this module's interface) with its arguments checked first;
    ``kernel.__wrapped__`` is the unchecked function."""

    @functools.wraps(kernel)
    def checked(query: Tensor, kv: PagedKV, *, scale: float, mask: Tensor | None = None) -> Tensor:
        check_paged_inputs(query, kv, scale=scale, mask=mask)
        return kernel(query, kv, scale=scale, mask=mask)

    return checked  # type: ignore[return-value]
