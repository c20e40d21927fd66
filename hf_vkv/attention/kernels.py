"""Paged attention kernels: a torch reference, and the dispatcher that picks the fastest one.

Every kernel follows the interface of :mod:`hf_vkv.attention.paged_interface` (shapes, the mask
and offset rules, zeros for a query with nothing to attend to) and checks its arguments through
it; the Triton kernel lives in :mod:`hf_vkv.attention.triton_paged`, imported only when it runs.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from .paged_interface import check_block_ids, check_caches, check_paged_inputs, paged_kernel
from ..kv_records import PagedKV

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

#: flash-attn 2's ``flash_attn_with_kvcache`` documents for its paged KV cache: "page_block_size
#: must be a multiple of 256" (flash_attn/flash_attn_interface.py, argument ``k_cache``).
FLASH_ATTN_BLOCK_MULTIPLE = 256



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
        check_block_ids(blocks, num_blocks)
    return blocks, positions % block_size


def _gather(cache: Tensor, blocks: Tensor, in_block: Tensor) -> Tensor:
    """``cache[blocks[b, t], in_block[t], h, :]`` as a contiguous ``[batch, kv_heads, kv_len, head_dim]``.

    When blocks and in-block positions flatten into one token axis (``stride(0) == block_size * stride(1)``, true
    of a contiguous pool and of the cache's token-major store views), one ``index_select`` of token
    rows and one transposing copy; otherwise one advanced index over all three axes (about 3x slower
    on the CPU, measured with benchmarks/paged_cpu.py kernels's shapes).
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


def gather_kv(kv: PagedKV) -> tuple[Tensor, Tensor]:
    """Copy tokens ``[kv_offset, kv_offset + kv_len)`` of every row out of the paged caches.

    Args:
        kv: the caches (``[num_blocks, block_size, kv_heads, head_dim]``, ``stride(-1) == 1``) and
            int32 ``[batch, max_blocks]`` tables, every row's entries for the blocks covering
            ``[kv_offset, kv_offset + kv_len)`` valid (entries before them are not read);
            ``kv.kv_lens`` is not read (every row's ``kv_len`` tokens are copied).

    Returns:
        ``(keys, values)``, each a new contiguous ``[batch, kv_heads, kv_len, head_dim]`` tensor of
        the caches' dtype: an exact copy, made by one advanced index per tensor.
    """
    check_caches(kv)
    key_cache, value_cache, block_tables = kv.caches()
    blocks, in_block = _token_index(block_tables, block_size=key_cache.shape[1], num_blocks=key_cache.shape[0],
                                    kv_offset=kv.kv_offset, kv_len=kv.kv_len, valid=None)
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


@paged_kernel
def paged_attention_reference(query: Tensor, kv: PagedKV, *, scale: float, mask: Tensor | None = None) -> Tensor:
    """Paged attention by gathering K/V (one copy each) and calling
    ``F.scaled_dot_product_attention``; CPU or GPU, any dtype the interface allows.

    Shapes and semantics: see :mod:`~hf_vkv.attention.paged_interface`. Returns
    ``[batch, q_heads, q, head_dim]`` in the query's dtype, zeros for query rows with nothing to
    attend to.
    """
    key_cache, value_cache, block_tables = kv.caches()
    kv_offset, kv_len, kv_lens = kv.kv_offset, kv.kv_len, kv.kv_lens
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


def _paged_attention_flash(query: Tensor, kv: PagedKV, *, scale: float) -> Tensor:
    """flash-attn's paged path. UNVERIFIED: flash-attn cannot be installed where this was written,
    so this branch has never run; it follows flash-attn's documented ``flash_attn_with_kvcache``
    arguments (q ``[batch, q, heads, dim]``, ``cache_seqlens`` int32, ``block_table`` int32)."""
    from flash_attn import flash_attn_with_kvcache

    seqlens = kv.kv_lens if kv.kv_lens is not None else torch.full(
        (query.shape[0],), kv.kv_len, dtype=torch.int32, device=query.device)
    out = flash_attn_with_kvcache(query.transpose(1, 2), kv.key_cache, kv.value_cache, cache_seqlens=seqlens,
                                  block_table=kv.block_tables.contiguous(), softmax_scale=float(scale), causal=True)
    return out.transpose(1, 2)  # [batch, q_heads, q, head_dim]


@paged_kernel
def paged_attention(query: Tensor, kv: PagedKV, *, scale: float, mask: Tensor | None = None) -> Tensor:
    """Paged attention with the fastest kernel available (see :func:`select_paged_backend`).

    Same arguments, shapes and result as :func:`paged_attention_reference`; the arguments are
    checked once (:func:`~hf_vkv.attention.paged_interface.paged_kernel`), and the kernel picked
    runs unchecked.
    """
    backend = select_paged_backend(query, kv.key_cache, kv_offset=kv.kv_offset, mask=mask)
    if backend == "flash_attn":
        return _paged_attention_flash(query, kv, scale=scale)
    if backend == "triton":
        from .triton_paged import paged_attention_triton

        return paged_attention_triton.__wrapped__(query, kv, scale=scale, mask=mask)
    return paged_attention_reference.__wrapped__(query, kv, scale=scale, mask=mask)
