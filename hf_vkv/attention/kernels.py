"""Paged attention kernels: a torch reference, and the dispatcher that picks the fastest one.

The paged layout keeps key/value tokens in a pool of fixed-size blocks; each row (sequence) owns a
block table that lists, in order, the blocks holding its tokens. A kernel reads K/V through that
table instead of through a contiguous tensor.

The interface (shared by :func:`paged_attention_reference`, :func:`paged_attention`,
:func:`hf_vkv.attention.triton_paged.paged_attention_triton`):

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
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "PagedBackend",
    "attend_mask",
    "check_paged_inputs",
    "flash_attn_block_size_ok",
    "gather_kv",
    "paged_attention",
    "paged_attention_reference",
    "select_paged_backend",
]

PagedBackend = Literal["flash_attn", "triton", "reference"]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: flash-attn 2's ``flash_attn_with_kvcache`` documents for its paged KV cache: "page_block_size
#: must be a multiple of 256" (flash_attn/flash_attn_interface.py, argument ``k_cache``).
FLASH_ATTN_BLOCK_MULTIPLE = 256


def _check_caches(key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, *, kv_offset: int,
                  kv_len: int) -> None:
    """The checks :func:`gather_kv` and the attention kernels share (caches, tables, offsets)."""
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache), ("block_tables", block_tables)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    for name, value in (("kv_offset", kv_offset), ("kv_len", kv_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    for name, t in (("key_cache", key_cache), ("value_cache", value_cache)):
        if t.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name} must be float32, float16 or bfloat16, got {t.dtype}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got shape "
                             f"{tuple(t.shape)}")
        if t.stride(-1) != 1 and t.shape[-1] > 1:
            raise ValueError(f"{name} must have a contiguous last dimension (stride(-1) == 1), got strides "
                             f"{t.stride()}; pass a view of a store whose head_dim is innermost")
    if key_cache.shape != value_cache.shape or key_cache.dtype != value_cache.dtype:
        raise ValueError(f"key_cache ({key_cache.dtype} {tuple(key_cache.shape)}) and value_cache "
                         f"({value_cache.dtype} {tuple(value_cache.shape)}) must have the same shape and dtype")
    block_size, kv_heads = key_cache.shape[1], key_cache.shape[2]
    if block_size < 1 or kv_heads < 1:
        raise ValueError(f"key_cache needs block_size >= 1 and kv_heads >= 1, got shape {tuple(key_cache.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2:
        raise ValueError(f"block_tables must be int32 [batch, max_blocks], got {block_tables.dtype} "
                         f"{tuple(block_tables.shape)}")
    if block_tables.shape[1] * block_size < kv_offset + kv_len:
        raise ValueError(f"block_tables has {block_tables.shape[1]} blocks of {block_size} tokens a row, fewer "
                         f"than kv_offset + kv_len = {kv_offset + kv_len} tokens; give every row enough entries")
    devices = {t.device for t in (key_cache, value_cache, block_tables)}
    if len(devices) > 1:
        raise ValueError(f"key_cache, value_cache and block_tables must be on one device, got "
                         f"{sorted(str(d) for d in devices)}")


def check_paged_inputs(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    *,
    kv_offset: int,
    kv_len: int,
    scale: float,
    mask: Tensor | None = None,
    kv_lens: Tensor | None = None,
) -> None:
    """Raise ``TypeError``/``ValueError`` (naming the argument and the fix) unless the arguments
    follow the interface of this module's docstring. Reads tensor values only for CPU tensors."""
    _check_caches(key_cache, value_cache, block_tables, kv_offset=kv_offset, kv_len=kv_len)
    if not isinstance(query, Tensor):
        raise TypeError(f"query must be a torch.Tensor, got {type(query).__name__}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
        raise ValueError(f"scale must be a finite float (usually head_dim ** -0.5), got {scale!r}")
    if query.dtype != key_cache.dtype:
        raise TypeError(f"query has dtype {query.dtype} but the caches have {key_cache.dtype}; cast the query")
    if query.dim() != 4:
        raise ValueError(f"query must be [batch, q_heads, q, head_dim], got shape {tuple(query.shape)}")
    batch, q_heads, q, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    if head_dim != key_cache.shape[3]:
        raise ValueError(f"query head_dim {head_dim} differs from the caches' head_dim {key_cache.shape[3]}")
    if q_heads % kv_heads:
        raise ValueError(f"q_heads ({q_heads}) must be a multiple of the caches' kv_heads ({kv_heads})")
    if block_tables.shape[0] != batch:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but query has batch {batch}")
    devices = {query.device, key_cache.device}
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor (True = attend) or None for causal, got "
                            f"{getattr(mask, 'dtype', type(mask).__name__)}")
        if tuple(mask.shape) != (batch, 1, q, kv_len):
            raise ValueError(f"mask must be [batch, 1, q, kv_len] = {[batch, 1, q, kv_len]}, got {list(mask.shape)}")
        devices.add(mask.device)
    if kv_lens is not None:
        if not isinstance(kv_lens, Tensor) or kv_lens.dtype != torch.int32 or tuple(kv_lens.shape) != (batch,):
            raise ValueError(f"kv_lens must be int32 [batch={batch}] or None, got "
                             f"{getattr(kv_lens, 'dtype', type(kv_lens).__name__)} "
                             f"{tuple(getattr(kv_lens, 'shape', ()))}")
        devices.add(kv_lens.device)
    if len(devices) > 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(str(d) for d in devices)}")
    if block_tables.device.type != "cpu" or not batch:
        return
    if kv_lens is not None:
        low, high = int(kv_lens.min()), int(kv_lens.max())
        if low < 0 or high > kv_len:
            raise ValueError(f"kv_lens must lie in [0, kv_len={kv_len}], got values in [{low}, {high}]")
    block_size = key_cache.shape[1]
    ends = kv_offset + (kv_lens.long() if kv_lens is not None else torch.full((batch,), kv_len))  # [batch]
    starts = torch.arange(block_tables.shape[1]) * block_size  # first position of each entry's block
    read = (starts[None, :] + block_size > kv_offset) & (starts[None, :] < ends[:, None])  # [batch, max_blocks]
    _check_block_ids(block_tables[read], key_cache.shape[0])


def _check_block_ids(used: Tensor, num_blocks: int) -> None:
    """``used``: the block ids a kernel will read (any shape); each must index the pool."""
    if used.numel():
        low, high = int(used.min()), int(used.max())
        if low < 0 or high >= num_blocks:
            raise ValueError(f"block_tables refers to block {low if low < 0 else high} for a token that is read, "
                             f"but the caches hold blocks [0, {num_blocks})")


def _token_index(
    block_tables: Tensor, *, block_size: int, num_blocks: int, kv_offset: int, kv_len: int, valid: Tensor | None
) -> tuple[Tensor, Tensor]:
    """Block id and position in the block of each token ``[kv_offset, kv_offset + kv_len)`` of each row.

    Returns ``blocks`` int64 ``[batch, kv_len]`` and ``in_block`` int64 ``[kv_len]``. Where ``valid``
    (bool ``[batch, kv_len]``) is False the table entry is not trusted: block 0 is read instead, so
    that garbage entries past a row's length never index out of the pool.
    """
    positions = torch.arange(kv_offset, kv_offset + kv_len, device=block_tables.device)
    blocks = block_tables.index_select(1, positions // block_size).long()  # [batch, kv_len]
    if valid is not None:
        blocks = blocks.masked_fill(~valid, 0)
    if blocks.device.type == "cpu":
        _check_block_ids(blocks, num_blocks)
    return blocks, positions % block_size


def _gather(cache: Tensor, blocks: Tensor, in_block: Tensor) -> Tensor:
    """``cache[blocks[b, t], in_block[t], h, :]`` as a contiguous ``[batch, kv_heads, kv_len, head_dim]``.

    When blocks and in-block positions flatten into one token axis (``stride(0) == block_size * stride(1)``, true
    of a contiguous pool and of the cache's token-major store views), one ``index_select`` of token
    rows and one transposing copy; otherwise one advanced index over all three axes (about 3x slower
    on the CPU, measured with benchmarks/paged_attention.py's shapes).
    """
    num_blocks, block_size, kv_heads, head_dim = cache.shape
    batch, kv_len = blocks.shape
    if cache.stride(0) == block_size * cache.stride(1) or num_blocks == 1:
        tokens = cache.as_strided((num_blocks * block_size, kv_heads, head_dim),
                                  (cache.stride(1), cache.stride(2), cache.stride(3)), cache.storage_offset())
        rows = tokens.index_select(0, (blocks * block_size + in_block).flatten())  # [batch * kv_len, Hkv, D]
        return rows.view(batch, kv_len, kv_heads, head_dim).transpose(1, 2).contiguous()
    heads = torch.arange(kv_heads, device=cache.device)
    return cache[blocks[:, None, :], in_block[None, None, :], heads[None, :, None]]


def gather_kv(
    key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, *, kv_offset: int, kv_len: int
) -> tuple[Tensor, Tensor]:
    """Copy tokens ``[kv_offset, kv_offset + kv_len)`` of every row out of the paged caches.

    Args:
        key_cache, value_cache: ``[num_blocks, block_size, kv_heads, head_dim]``, ``stride(-1) == 1``.
        block_tables: int32 ``[batch, max_blocks]``; every row's entries for the blocks covering
            ``[kv_offset, kv_offset + kv_len)`` must be valid (entries before them are not read).

    Returns:
        ``(keys, values)``, each a new contiguous ``[batch, kv_heads, kv_len, head_dim]`` tensor of
        the caches' dtype: an exact copy, made by one advanced index per tensor.
    """
    _check_caches(key_cache, value_cache, block_tables, kv_offset=kv_offset, kv_len=kv_len)
    blocks, in_block = _token_index(block_tables, block_size=key_cache.shape[1], num_blocks=key_cache.shape[0],
                                 kv_offset=kv_offset, kv_len=kv_len, valid=None)
    return _gather(key_cache, blocks, in_block), _gather(value_cache, blocks, in_block)


def attend_mask(
    *, batch: int, q: int, kv_len: int, mask: Tensor | None, kv_lens: Tensor | None, device: torch.device
) -> Tensor:
    """Which tokens each query attends: bool ``[batch, 1, q, kv_len]`` (column ``c`` = absolute token
    ``kv_offset + c``), the interface's rule made explicit (``mask`` or causal, and ``c < L_b``)."""
    cols = torch.arange(kv_len, device=device)
    lengths = (kv_lens.long() if kv_lens is not None else torch.full((batch,), kv_len, device=device))
    in_row = cols[None, None, None, :] < lengths[:, None, None, None]  # [batch, 1, 1, kv_len]
    if mask is not None:
        return mask & in_row
    own = lengths[:, None] - q + torch.arange(q, device=device)[None, :]  # [batch, q]: query i's column
    return (cols[None, None, None, :] <= own[:, None, :, None]) & in_row


def paged_attention_reference(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    *,
    kv_offset: int,
    kv_len: int,
    scale: float,
    mask: Tensor | None = None,
    kv_lens: Tensor | None = None,
) -> Tensor:
    """Paged attention by gathering K/V (one copy each) and calling
    ``F.scaled_dot_product_attention``; CPU or GPU, any dtype the interface allows.

    Shapes and semantics: see the module docstring. Returns ``[batch, q_heads, q, head_dim]`` in the
    query's dtype, zeros for query rows with nothing to attend to.
    """
    check_paged_inputs(query, key_cache, value_cache, block_tables, kv_offset=kv_offset, kv_len=kv_len,
                       scale=scale, mask=mask, kv_lens=kv_lens)
    batch, q_heads, q, _ = query.shape
    if kv_len == 0 or batch == 0 or q == 0:
        return query.new_zeros(query.shape)
    valid = None  # [batch, kv_len]: table entries past a row's length are garbage, never index with them
    if kv_lens is not None:
        valid = torch.arange(kv_len, device=query.device)[None, :] < kv_lens.long()[:, None]
    blocks, in_block = _token_index(block_tables, block_size=key_cache.shape[1], num_blocks=key_cache.shape[0],
                                 kv_offset=kv_offset, kv_len=kv_len, valid=valid)
    keys, values = _gather(key_cache, blocks, in_block), _gather(value_cache, blocks, in_block)  # [B, Hkv, kv_len, D]
    gqa = q_heads != key_cache.shape[2]
    if mask is None and kv_lens is None and q in (1, kv_len):
        # One query sees every token, or q == kv_len where bottom-right causal is sdpa's is_causal:
        # no explicit mask (sdpa's faster path) and no row is empty.
        return F.scaled_dot_product_attention(query, keys, values, is_causal=q > 1, scale=float(scale),
                                              enable_gqa=gqa)
    allowed = attend_mask(batch=batch, q=q, kv_len=kv_len, mask=mask, kv_lens=kv_lens, device=query.device)
    out = F.scaled_dot_product_attention(query, keys, values, attn_mask=allowed, scale=float(scale), enable_gqa=gqa)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)  # empty rows: zeros, not NaN


def flash_attn_block_size_ok(block_size: int) -> bool:
    """Whether flash-attn 2's paged ``flash_attn_with_kvcache`` accepts this block size: it
    documents that ``page_block_size must be a multiple of 256``."""
    return block_size % FLASH_ATTN_BLOCK_MULTIPLE == 0


def _flash_attn_usable(query: Tensor, key_cache: Tensor, *, kv_offset: int, mask: Tensor | None) -> bool:
    """flash-attn covers this call: CUDA, fp16/bf16, block size a multiple of 256, no explicit mask
    (its causal rule is ours) and no offset (it cannot skip the blocks before ``kv_offset``)."""
    if query.device.type != "cuda" or query.dtype == torch.float32 or mask is not None or kv_offset != 0:
        return False
    if not flash_attn_block_size_ok(key_cache.shape[1]) or query.shape[-1] > 256 or query.shape[-1] % 8:
        return False
    try:
        import flash_attn  # noqa: F401
    except ImportError:
        return False
    return True


def _triton_usable(query: Tensor) -> bool:
    if query.device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def select_paged_backend(
    query: Tensor, key_cache: Tensor, *, kv_offset: int, mask: Tensor | None = None
) -> PagedBackend:
    """The kernel :func:`paged_attention` runs for these arguments: ``"flash_attn"`` (CUDA,
    flash-attn installed, fp16/bf16, ``block_size % 256 == 0``, ``mask is None``, ``kv_offset == 0``),
    else ``"triton"`` (CUDA with triton), else ``"reference"``."""
    if _flash_attn_usable(query, key_cache, kv_offset=kv_offset, mask=mask):
        return "flash_attn"
    if _triton_usable(query):
        return "triton"
    return "reference"


def _paged_attention_flash(
    query: Tensor, key_cache: Tensor, value_cache: Tensor, block_tables: Tensor, *, kv_len: int, scale: float,
    kv_lens: Tensor | None,
) -> Tensor:
    """flash-attn's paged path. UNVERIFIED: flash-attn cannot be installed where this was written,
    so this branch has never run; it follows flash-attn's documented ``flash_attn_with_kvcache``
    arguments (q ``[batch, q, heads, dim]``, ``cache_seqlens`` int32, ``block_table`` int32)."""
    from flash_attn import flash_attn_with_kvcache

    seqlens = kv_lens if kv_lens is not None else torch.full(
        (query.shape[0],), kv_len, dtype=torch.int32, device=query.device)
    out = flash_attn_with_kvcache(query.transpose(1, 2), key_cache, value_cache, cache_seqlens=seqlens,
                                  block_table=block_tables.contiguous(), softmax_scale=float(scale), causal=True)
    return out.transpose(1, 2)  # [batch, q_heads, q, head_dim]


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    block_tables: Tensor,
    *,
    kv_offset: int,
    kv_len: int,
    scale: float,
    mask: Tensor | None = None,
    kv_lens: Tensor | None = None,
) -> Tensor:
    """Paged attention with the fastest kernel available (see :func:`select_paged_backend`).

    Same arguments, shapes and result as :func:`paged_attention_reference` (module docstring).
    """
    check_paged_inputs(query, key_cache, value_cache, block_tables, kv_offset=kv_offset, kv_len=kv_len,
                       scale=scale, mask=mask, kv_lens=kv_lens)
    backend = select_paged_backend(query, key_cache, kv_offset=kv_offset, mask=mask)
    if backend == "flash_attn":
        return _paged_attention_flash(query, key_cache, value_cache, block_tables, kv_len=kv_len, scale=scale,
                                      kv_lens=kv_lens)
    if backend == "triton":
        from .triton_paged import paged_attention_triton

        return paged_attention_triton(query, key_cache, value_cache, block_tables, kv_offset=kv_offset,
                                      kv_len=kv_len, scale=scale, mask=mask, kv_lens=kv_lens)
    return paged_attention_reference(query, key_cache, value_cache, block_tables, kv_offset=kv_offset,
                                     kv_len=kv_len, scale=scale, mask=mask, kv_lens=kv_lens)
