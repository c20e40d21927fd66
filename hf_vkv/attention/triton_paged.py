"""A Triton paged attention kernel (decode and prefill) that reads K/V through block tables.

:func:`paged_attention_triton` has the interface of :mod:`hf_vkv.attention.kernels` (shapes, the
causal rule, masks, ragged ``kv_lens``, zeros for query rows with nothing to attend to). This module
imports Triton, so import it only where Triton is wanted (:func:`kernels.paged_attention` does so
lazily). CUDA tensors run compiled; CPU tensors run only under ``TRITON_INTERPRET=1`` (the tests).

How the kernel works (one program per ``(row, kv head, tile of query rows, KV split)``):

* **GQA in-kernel.** The ``G = q_heads // kv_heads`` query heads that share a kv head are packed
  into the rows of one tile: tile row ``m`` is query token ``m // G`` of head ``kv_head * G + m % G``.
  A K/V tile is loaded once for all of them (no repeat of K/V), and decode (``q == 1``) still fills
  ``G`` rows of the ``tl.dot`` instead of one.
* **Paged reads.** A KV tile is ``BLOCK_N`` consecutive tokens; for each token the kernel looks up
  its block (``block_tables[b, pos // block_size]``) and its position in the block (``pos % block_size``), so any
  ``block_size >= 1`` works (odd ones too) and the caches may have any strides with
  ``stride(-1) == 1``. Table entries are loaded only for tokens the row has, so entries before
  ``kv_offset`` or past ``L_b`` are never read.
* **Online softmax** in fp32 (base 2) over the KV tiles; ``-inf`` rows are guarded, so a query row
  with nothing allowed ends with a zero sum and is written as zeros.
* **Split-KV for decode.** When ``batch * kv_heads * query tiles`` programs cannot fill the GPU, the
  KV range is split across programs that write partial (sum, max, unnormalized output) in fp32,
  and a second small kernel combines them (flash-decoding).

Interpreted (``TRITON_INTERPRET=1``), bfloat16 tiles are widened to fp32 before each ``tl.dot``:
Triton 3.9's interpreter multiplies bf16 tiles wrongly. Compiled code never widens.

Tile sizes were chosen for an H100 without running on one (BLOCK_N = 64, 4 warps, query tiles of
16 rows for decode and 64 for prefill); the GPU benchmark in ``benchmarks/paged_cpu.py kernels``
is where they get tuned.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction
from torch import Tensor

from .paged_interface import paged_kernel
from ..kv_records import PagedKV
from ..memory.errors import ArgumentError

__all__ = ["paged_attention_triton"]

_LOG2E = 1.4426950408889634

# The kernels call only builtins of triton.language (tl.full, tl.reduce, ...), not its jit'd helpers
# (tl.zeros, tl.max, tl.sum, tl.cdiv): when triton was imported before TRITON_INTERPRET=1 was set
# (transformers imports it), those helpers are compiled-mode functions that the interpreter cannot
# call, while kernels defined here after the variable is set still run interpreted. The reductions
# use the very combine functions behind tl.max / tl.sum: compiled, the code is the same; interpreted,
# the interpreter recognizes them and reduces in numpy (a combine function of our own would be called
# once per element pair, ~100x slower).


@triton.jit
def _max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def _add_combine(a, b):
    return a + b


_MAX = getattr(tl.standard, "_elementwise_max", _max_combine)
_SUM = getattr(tl.standard, "_sum_combine", _add_combine)


@triton.jit
def _paged_attention_kernel(
    Q, K, V, BT, KV_LENS, MASK, OUT, PART_ACC, PART_MAX, PART_SUM,
    stride_qb, stride_qh, stride_qt,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_btb, stride_btj,
    stride_mb, stride_mq, stride_mk,
    stride_ob, stride_oh, stride_ot,
    kv_heads, q_len, kv_offset, kv_len, block_size, scale_log2,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
    HAS_MASK: tl.constexpr, HAS_KV_LENS: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_bh = tl.program_id(0)  # row * kv_heads + kv head
    pid_m = tl.program_id(1)  # tile of (query token, head of the group) rows
    pid_s = tl.program_id(2)  # KV split
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)

    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    n_rows = q_len * GROUP
    row_ok = rows < n_rows
    tok = rows // GROUP  # query token of each row
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < HEAD_DIM

    q = tl.load(Q + b * stride_qb + head[:, None] * stride_qh + tok[:, None] * stride_qt + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    if HAS_KV_LENS:
        length = tl.load(KV_LENS + b).to(tl.int32)
    else:
        length = kv_len
    diag = length - q_len  # query token i attends columns c <= diag + i (causal rule)
    if HAS_MASK:
        hi = length
    else:
        last_tok = tl.minimum((pid_m * BLOCK_M + BLOCK_M - 1) // GROUP, q_len - 1)
        hi = tl.minimum(length, diag + last_tok + 1)
    hi = tl.maximum(hi, 0)
    n_tiles = (hi + BLOCK_N - 1) // BLOCK_N
    per_split = (n_tiles + NUM_SPLITS - 1) // NUM_SPLITS
    t_begin = pid_s * per_split
    t_end = tl.minimum(t_begin + per_split, n_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    bt_row = BT + b * stride_btb
    for t in range(t_begin, t_end):
        cols = t * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N], relative to kv_offset
        col_ok = cols < length
        pos = kv_offset + cols
        blk = tl.load(bt_row + (pos // block_size) * stride_btj, mask=col_ok, other=0).to(tl.int64)
        in_block = (pos % block_size).to(tl.int64)
        k_off = blk * stride_kb + in_block * stride_ks + kvh * stride_kh  # [BLOCK_N]
        v_off = blk * stride_vb + in_block * stride_vs + kvh * stride_vh
        kt = tl.load(K + k_off[None, :] + d[:, None], mask=col_ok[None, :] & d_ok[:, None], other=0.0)
        if UPCAST:
            kt = kt.to(tl.float32)
        if IEEE:
            s = tl.dot(q, kt, input_precision="ieee")
        else:
            s = tl.dot(q, kt)
        s = s * scale_log2  # [BLOCK_M, BLOCK_N], log2 domain
        if HAS_MASK:
            allowed = tl.load(MASK + b * stride_mb + tok[:, None] * stride_mq + cols[None, :] * stride_mk,
                              mask=row_ok[:, None] & col_ok[None, :], other=0) != 0
            allowed = allowed & col_ok[None, :]
        else:
            allowed = (cols[None, :] <= diag + tok[:, None]) & col_ok[None, :]
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, 1, _MAX))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with nothing allowed yet
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.reduce(p, 1, _SUM)
        v = tl.load(V + v_off[:, None] + d[None, :], mask=col_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            v = v.to(tl.float32)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + tok[:, None] * stride_ot + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials: [batch * kv_heads, NUM_SPLITS, n_rows] (+ [BLOCK_D] for the output)
        part = (pid_bh.to(tl.int64) * NUM_SPLITS + pid_s) * n_rows + rows
        tl.store(PART_MAX + part, m_i, mask=row_ok)
        tl.store(PART_SUM + part, l_i, mask=row_ok)
        tl.store(PART_ACC + part[:, None] * BLOCK_D + d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _combine_splits_kernel(
    PART_ACC, PART_MAX, PART_SUM, OUT,
    stride_ob, stride_oh, stride_ot,
    kv_heads, q_len,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, NUM_SPLITS: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = (pid_bh // kv_heads).to(tl.int64)
    kvh = (pid_bh % kv_heads).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_rows = q_len * GROUP
    row_ok = rows < n_rows
    tok = rows // GROUP
    head = kvh * GROUP + rows % GROUP
    d = tl.arange(0, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.full([BLOCK_M], 0.0, tl.float32)
    acc = tl.full([BLOCK_M, BLOCK_D], 0.0, tl.float32)
    for s in range(NUM_SPLITS):
        part = (pid_bh.to(tl.int64) * NUM_SPLITS + s) * n_rows + rows
        m_s = tl.load(PART_MAX + part, mask=row_ok, other=float("-inf"))
        l_s = tl.load(PART_SUM + part, mask=row_ok, other=0.0)
        a_s = tl.load(PART_ACC + part[:, None] * BLOCK_D + d[None, :], mask=row_ok[:, None], other=0.0)
        m_new = tl.maximum(m_i, m_s)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        beta = tl.exp2(m_s - m_safe)
        l_i = l_i * alpha + l_s * beta
        acc = acc * alpha[:, None] + a_s * beta[:, None]
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(OUT + b * stride_ob + head[:, None] * stride_oh + tok[:, None] * stride_ot + d[None, :],
             out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & (d < HEAD_DIM)[None, :])


@functools.cache
def _multiprocessors(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _default_splits(programs: int, kv_len: int, block_n: int, device: torch.device) -> int:
    """How many programs share one query tile's KV range: enough to give the GPU about two waves
    of programs, never fewer than 4 KV tiles per split. One on the CPU (the interpreter)."""
    if device.type != "cuda":
        return 1
    sms = _multiprocessors(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    return max(1, min(triton.cdiv(2 * sms, programs), triton.cdiv(kv_len, 4 * block_n), 64))


#: Whether the kernels were defined in interpreter mode (``TRITON_INTERPRET=1`` when this module was
#: first imported): then they run on CPU tensors, in numpy, and never compile.
INTERPRETED: bool = not isinstance(_paged_attention_kernel, JITFunction)


def _interpreting() -> bool:
    return INTERPRETED


def launch_paged_attention(
    query: Tensor,
    kv: PagedKV,
    *,
    scale: float,
    mask: Tensor | None,
    block_m: int | None = None,
    block_n: int = 64,
    num_splits: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> Tensor:
    """Run the kernel on already-checked arguments with explicit tiling (tests and benchmarks use
    this to force several KV tiles and splits on small shapes).

    ``block_m``: query rows per tile (default 16 when ``q * G <= 16``, else 64); ``block_n``: KV
    tokens per tile; ``num_splits``: KV splits (default: :func:`_default_splits`). Returns
    ``[batch, q_heads, q, head_dim]`` in the query's dtype.
    """
    key_cache, value_cache, block_tables = kv.caches()
    kv_offset, kv_len, kv_lens = kv.kv_offset, kv.kv_len, kv.kv_lens
    batch, q_heads, q_len, head_dim = query.shape
    kv_heads = key_cache.shape[2]
    group = q_heads // kv_heads
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)  # [B, Hq, q, D]
    if out.numel() == 0:
        return out
    if query.stride(-1) != 1:
        query = query.contiguous()
    n_rows = q_len * group
    if block_m is None:
        block_m = 16 if n_rows <= 16 else 64
    block_d = max(16, triton.next_power_of_2(head_dim))
    m_tiles = triton.cdiv(n_rows, block_m)
    if num_splits is None:
        num_splits = _default_splits(batch * kv_heads * m_tiles, kv_len, block_n, query.device)
    if num_splits > 1:
        part_acc = torch.empty((batch * kv_heads, num_splits, n_rows, block_d), dtype=torch.float32,
                               device=query.device)
        part_max = torch.empty((batch * kv_heads, num_splits, n_rows), dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # never touched: the kernel stores to OUT directly
    mask_u8 = mask.view(torch.uint8) if mask is not None else block_tables  # dummy pointer when no mask
    mask_strides = (mask_u8.stride(0), mask_u8.stride(2), mask_u8.stride(3)) if mask is not None else (0, 0, 0)
    lens = kv_lens if kv_lens is not None else block_tables  # dummy pointer when no kv_lens
    # Triton 3.9's interpreter computes tl.dot of bfloat16 tiles wrongly (errors of 1e10 on a 16x16
    # product); interpreted, bf16 tiles are widened to fp32 before each dot. Compiled code never is.
    upcast = query.dtype == torch.bfloat16 and _interpreting()
    grid = (batch * kv_heads, m_tiles, num_splits)
    _paged_attention_kernel[grid](
        query, key_cache, value_cache, block_tables, lens, mask_u8, out, part_acc, part_max, part_sum,
        query.stride(0), query.stride(1), query.stride(2),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        block_tables.stride(0), block_tables.stride(1),
        *mask_strides,
        out.stride(0), out.stride(1), out.stride(2),
        kv_heads, q_len, kv_offset, kv_len, key_cache.shape[1], float(scale) * _LOG2E,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, HAS_MASK=mask is not None, HAS_KV_LENS=kv_lens is not None,
        IEEE=query.dtype == torch.float32 or upcast, UPCAST=upcast, num_warps=num_warps, num_stages=num_stages,
    )
    if num_splits > 1:
        _combine_splits_kernel[(batch * kv_heads, m_tiles)](
            part_acc, part_max, part_sum, out, out.stride(0), out.stride(1), out.stride(2), kv_heads, q_len,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_M=block_m, NUM_SPLITS=num_splits,
            num_warps=num_warps,
        )
    return out


@paged_kernel
def paged_attention_triton(query: Tensor, kv: PagedKV, *, scale: float, mask: Tensor | None = None) -> Tensor:
    """Paged attention in one Triton kernel (plus a combine kernel when the KV range is split).

    Arguments and result as :func:`hf_vkv.attention.kernels.paged_attention_reference`:
    query ``[batch, q_heads, q, head_dim]``, ``kv`` with caches ``[num_blocks, block_size, kv_heads,
    head_dim]``, int32 ``block_tables [batch, max_blocks]`` and optional int32 ``kv_lens [batch]``,
    optional bool ``mask [batch, 1, q, kv_len]``; returns ``[batch, q_heads, q, head_dim]`` in the query's dtype (fp32
    accumulation), zeros for query rows with nothing to attend to.
    """
    if query.device.type != "cuda" and not _interpreting():
        raise ArgumentError(f"paged_attention_triton needs CUDA tensors (got {query.device}); on the CPU use "
                            f"paged_attention_reference, or set TRITON_INTERPRET=1 before this module is first "
                            f"imported to run the kernel interpreted")
    return launch_paged_attention(query, kv, scale=scale, mask=mask)
