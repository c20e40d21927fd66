"""The cascade attention's pieces against a reference: the log-sum-exp merge, the per-cluster
decode (GQA and MHA, masks, fp32 and bf16, prefixes of 0 / 1 / a page / many pages), the mask
check, and the page-table query the cache derives clusters from."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_vkv.attention.cascade import attend_part, cascade_decode, merge_partials
from hf_vkv.kv_records import Cluster, SharedPrefix

PAGE_TOKENS = 16  # a 4 KiB head-major page of head dim 64 in float32


def _reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None,
               scale: float) -> torch.Tensor:
    """Softmax attention in float64 over all keys, GQA by repetition: [B, Hq, 1, Dv]."""
    g = query.shape[1] // key.shape[1]
    k = key.double().repeat_interleave(g, dim=1)
    v = value.double().repeat_interleave(g, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


def _case(rows: int, heads: int, kv_heads: int, prefix: int, suffix: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = prefix + suffix
    key = torch.randn(rows, kv_heads, total, 64, generator=g)
    value = torch.randn(rows, kv_heads, total, 64, generator=g)
    key[:, :, :prefix] = key[:1, :, :prefix]  # the rows share the prefix, as pages shared by rows do
    value[:, :, :prefix] = value[:1, :, :prefix]
    query = torch.randn(rows, heads, 1, 64, generator=g)
    return query.to(dtype), key.to(dtype), value.to(dtype)


def test_merging_two_parts_equals_attention_over_both() -> None:
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 3, 4, 8, generator=g) for _ in range(3))
    k, v = torch.randn(2, 3, 10, 8, generator=g), torch.randn(2, 3, 10, 8, generator=g)
    mask = torch.rand(2, 3, 4, 10, generator=g) > 0.3
    mask[0, 0, 0] = False  # a query with nothing to attend to anywhere: 0, as the paged kernels give
    mask[1, 2, 1, :6] = False  # ... and one with nothing in the first part only
    a = attend_part(q, k[..., :6, :], v[..., :6, :], scale=0.3, mask=mask[..., :6])
    b = attend_part(q, k[..., 6:, :], v[..., 6:, :], scale=0.3, mask=mask[..., 6:])
    merged = merge_partials(*a, *b)
    expected = torch.softmax((q.double() @ k.double().transpose(-1, -2) * 0.3).masked_fill(~mask, float("-inf")),
                             dim=-1).nan_to_num(0.0) @ v.double()
    assert torch.allclose(merged.double(), expected, atol=1e-6, rtol=0)
    assert torch.equal(merged[0, 0, 0], torch.zeros(8))
    empty = attend_part(q, k[..., :0, :], v[..., :0, :], scale=0.3, mask=None)
    assert torch.equal(merge_partials(*empty, *b), b[0])


@pytest.mark.parametrize("dtype, atol", [(torch.float32, 2e-6), (torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("prefix", [0, 1, PAGE_TOKENS, 7 * PAGE_TOKENS])
def test_cascade_decode_against_reference(dtype: torch.dtype, atol: float, heads: int, kv_heads: int,
                                          prefix: int) -> None:
    query, key, value = _case(6, heads, kv_heads, prefix, suffix=5, dtype=dtype)
    # rows 0-2 one cluster, rows 3 and 5 another (not consecutive), row 4 alone
    record = SharedPrefix(clusters=(Cluster(index=(0, 1, 2), tokens=prefix), Cluster(index=(3, 5), tokens=prefix)),
                          alone=(4,))
    key[3:, :, :prefix] = key[3, :, :prefix]  # the second cluster shares its own prefix
    value[3:, :, :prefix] = value[3, :, :prefix]
    mask = torch.ones(6, 1, 1, prefix + 5, dtype=torch.bool)
    mask[0:3, ..., : prefix // 2] = False  # left padding of the first prompt, the same in its rows
    mask[1, ..., -2] = False  # and a hole in one row's own suffix
    out = cascade_decode(query, key, value, mask=mask, scale=0.125, prefix=record)
    assert out.dtype == dtype and out.shape == (6, heads, 1, 64)
    expected = _reference(query, key, value, mask, 0.125)
    rows = [0, 1, 2, 3, 5]
    assert torch.allclose(out[rows].double(), expected[rows], atol=atol, rtol=0)
    assert torch.equal(out[4], torch.zeros_like(out[4]))  # left for the caller
    no_mask = cascade_decode(query, key, value, mask=None, scale=0.125, prefix=record)
    assert torch.allclose(no_mask[rows].double(), _reference(query, key, value, None, 0.125)[rows], atol=atol, rtol=0)


def test_cascade_matches_sdpa_closely_in_float32() -> None:
    query, key, value = _case(8, 9, 3, 2048, suffix=16, dtype=torch.float32)
    record = SharedPrefix(clusters=(Cluster(index=tuple(range(8)), tokens=2048),), alone=())
    out = cascade_decode(query, key, value, mask=None, scale=0.125, prefix=record)
    sdpa = F.scaled_dot_product_attention(query, key, value, scale=0.125, enable_gqa=True)
    assert (out - sdpa).abs().max().item() < 1e-5


def test_the_mask_is_checked_once_per_mask_object(monkeypatch: pytest.MonkeyPatch) -> None:
    import hf_vkv.kv_records as shared_prefix

    compared = []
    equal = torch.equal
    monkeypatch.setattr(shared_prefix.torch, "equal", lambda a, b: compared.append(1) or equal(a, b))
    record = SharedPrefix(clusters=(Cluster(index=(0, 1), tokens=4),), alone=(2,))
    mask = torch.ones(3, 1, 1, 6, dtype=torch.bool)
    assert record.mask_agrees(mask) and len(compared) == 1
    assert record.mask_agrees(mask) and len(compared) == 1  # the same mask object: not compared again (every layer)
    other = mask.clone()
    other[1, ..., 0] = False  # inside the prefix of one row only
    assert not record.mask_agrees(other) and len(compared) == 2  # another object: compared
    mask[1, ..., 5] = False  # in place, after the prefix: still agrees, compared anew
    assert record.mask_agrees(mask) and len(compared) == 3
    mask[1, ..., 0] = False  # in place, inside the prefix: the cached verdict is not reused
    assert not record.mask_agrees(mask) and len(compared) == 4


@pytest.mark.parametrize("heads, kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("prefix, suffix", [(1, 1), (PAGE_TOKENS, 3), (7 * PAGE_TOKENS, 5), (7 * PAGE_TOKENS, 0)])
def test_one_cluster_of_every_row_against_reference(heads: int, kv_heads: int, prefix: int, suffix: int) -> None:
    # the common step (a prompt's samples, beams): no mask, float32; keys at a cache's strides
    query, key, value = _case(4, heads, kv_heads, prefix, suffix=suffix, dtype=torch.float32)
    room = torch.zeros(4, kv_heads, prefix + suffix + 40, 64)
    room_v = torch.zeros_like(room)
    room[:, :, :prefix + suffix], room_v[:, :, :prefix + suffix] = key, value
    key, value = room[:, :, :prefix + suffix], room_v[:, :, :prefix + suffix]
    record = SharedPrefix(clusters=(Cluster(index=(0, 1, 2, 3), tokens=prefix),), alone=())
    out = cascade_decode(query, key, value, mask=None, scale=0.125, prefix=record)
    assert out.dtype == torch.float32 and out.shape == (4, heads, 1, 64)
    assert torch.allclose(out.double(), _reference(query, key, value, None, 0.125), atol=2e-6, rtol=0)


def test_the_finite_merge_skips_only_the_guard() -> None:
    g = torch.Generator().manual_seed(2)
    out_a, out_b = torch.randn(2, 3, 4, 8, generator=g), torch.randn(2, 3, 4, 8, generator=g)
    lse_a, lse_b = torch.randn(2, 3, 4, generator=g) * 5, torch.randn(2, 3, 4, generator=g) * 5
    assert torch.equal(merge_partials(out_a, lse_a, out_b, lse_b, finite=True),
                       merge_partials(out_a, lse_a, out_b, lse_b))
    # strided part a (the stacked prefix's [Hkv, n, G] seen as [n, Hkv, G]) as the cascade passes it
    assert torch.equal(merge_partials(out_a.transpose(0, 1).contiguous().transpose(0, 1), lse_a, out_b, lse_b),
                       merge_partials(out_a, lse_a, out_b, lse_b))


@pytest.mark.parametrize("threads", [2, 4])
def test_the_prefix_split_over_threads_against_reference(threads: int) -> None:
    from hf_vkv.attention.cascade import _prefix_splits

    assert _prefix_splits(3, 2048, threads) == {2: 2, 4: 4}[threads]  # 3 key heads: 6 / 12 (batch, head) pairs
    query, key, value = _case(4, 9, 3, 2048, suffix=3, dtype=torch.float32)
    record = SharedPrefix(clusters=(Cluster(index=(0, 1, 2, 3), tokens=2048),), alone=())
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = cascade_decode(query, key, value, mask=None, scale=0.125, prefix=record)
    finally:
        torch.set_num_threads(saved)
    assert torch.allclose(out.double(), _reference(query, key, value, None, 0.125), atol=2e-6, rtol=0)


def test_prefix_splits_only_whole_parts_of_enough_tokens() -> None:
    from hf_vkv.attention.cascade import MIN_SPLIT_TOKENS, _prefix_splits

    assert _prefix_splits(3, 2048, 1) == 1  # one thread: one part
    assert _prefix_splits(3, 2048, 3) == 1  # 3 heads over 3 threads: already even
    assert _prefix_splits(4, 2048, 2) == 1
    assert _prefix_splits(3, MIN_SPLIT_TOKENS, 2) == 1  # parts would be too short
    assert _prefix_splits(3, 2 * MIN_SPLIT_TOKENS + 16, 2) == 2
    assert _prefix_splits(3, 2 * MIN_SPLIT_TOKENS + 1, 2) == 1  # not whole parts
