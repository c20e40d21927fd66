"""What the token-major layout's zero-copy decode rests on, on this CPU: SDPA with one query a row
over token-strided key/value views (a head's token a multiple of 64 bytes) gives the bits it gives
over contiguous copies of them, so the layout hands the views themselves to SDPA
(:func:`hf_vkv.cache.sources.reads_need_contiguous`). A head dim of 50 float32 values (200
bytes) is the case the rule keeps copying for: its outputs differed in their last bits on the AMD
EPYC CPUs this project first ran on (on an Intel Xeon they do not). Run on every CI machine: a CPU
whose kernels read aligned strided views otherwise fails here."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from hf_vkv import devices


def _draws(dtype: torch.dtype, head_dim: int, count: int, seed: int):
    """``count`` random decode attentions over views laid out as the token-major layout's: each
    token holds several layers' keys then values, all heads of a layer together."""
    rng = random.Random(seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(count):
        rows, kv_heads, group = rng.choice([1, 2, 3, 8]), rng.choice([1, 2, 3, 4]), rng.choice([1, 2, 4])
        tokens, layers = rng.choice([1, 15, 16, 17, 129, 700, 1500]), rng.choice([1, 2, 5])
        query = torch.randn(rows, kv_heads * group, 1, head_dim, generator=g).to(dtype)
        store = torch.randn(rows, tokens + rng.choice([0, 3, 64]), layers, 2 * kv_heads * head_dim, generator=g).to(dtype)
        block = store[:, :tokens, rng.randrange(layers)]
        split = kv_heads * head_dim
        keys = block[..., :split].unflatten(-1, (kv_heads, head_dim)).transpose(1, 2)
        values = block[..., split:].unflatten(-1, (kv_heads, head_dim)).transpose(1, 2)
        mask = None
        if rng.random() < 0.5:  # left padding, as a batch of prompts of several lengths
            mask = torch.ones(rows, 1, 1, tokens, dtype=torch.bool)
            for row in range(rows):
                mask[row, ..., :rng.randrange(tokens)] = False
            mask[..., -1] = True
        yield query, keys, values, mask, group > 1


def _apart(dtype: torch.dtype, head_dim: int, count: int, seed: int) -> int:
    differ = 0
    for query, keys, values, mask, gqa in _draws(dtype, head_dim, count, seed):
        strided = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)
        copied = F.scaled_dot_product_attention(query, keys.contiguous(), values.contiguous(), attn_mask=mask,
                                                enable_gqa=gqa)
        differ += not torch.equal(strided, copied)
    return differ


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("dtype", "head_dim"), [(torch.float32, 16), (torch.float32, 64), (torch.float32, 128),
                                                 (torch.bfloat16, 64), (torch.float16, 128), (torch.bfloat16, 256)])
def test_sdpa_reads_aligned_token_strided_views_as_contiguous_ones(dtype: torch.dtype, head_dim: int,
                                                                   threads: int) -> None:
    assert head_dim * dtype.itemsize % devices.VIEW_ALIGNMENT_BYTES == 0
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert _apart(dtype, head_dim, 12, seed=head_dim + threads) == 0
    finally:
        torch.set_num_threads(before)


def test_the_comparison_sees_a_sum_taken_in_another_order() -> None:
    """The comparison can fail: the same attentions over their tokens in another order (equal in
    exact arithmetic, the softmax's sums taken otherwise) differ in their last bits. (200-byte
    heads through strided views rounded otherwise on the AMD EPYC CPUs this project first ran on,
    which is why :func:`~hf_vkv.cache.sources.views_misaligned` layouts copy; on an Intel Xeon
    they read as copies do, so that case is no counter-example everywhere.)"""
    differ = 0
    for query, keys, values, mask, gqa in _draws(torch.float32, 64, 24, seed=5):
        order = torch.randperm(keys.shape[2], generator=torch.Generator().manual_seed(keys.shape[2]))
        as_stored = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=gqa)
        reordered = F.scaled_dot_product_attention(query, keys[:, :, order].contiguous(), values[:, :, order].contiguous(),
                                                   attn_mask=None if mask is None else mask[..., order], enable_gqa=gqa)
        torch.testing.assert_close(as_stored, reordered)  # the same attention,
        differ += not torch.equal(as_stored, reordered)  # in other bits
    assert differ > 0
