"""Paged attention kernels against oracles: the torch reference against a naive per-row float64
sdpa, and the Triton kernel (interpreted on the CPU, ``TRITON_INTERPRET=1``) against the reference.

Every case builds K/V as plain contiguous per-row tensors first and only then scatters them into
a randomly permuted pool of blocks, so the oracle never goes through the code under test. The
pool is a strided store ``[num_blocks, block_size, layers, 2, kv_heads, head_dim]`` (the cache's
token-major layout); the caches are its views ``store[:, :, layer, 0]`` and ``store[:, :, layer, 1]``.
Block-table entries that must never be read (blocks wholly before ``kv_offset``, blocks past a
row's length, spare columns) hold -1 or 2**31 - 1, so a kernel that read one would fail loudly.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from hf_vkv.attention.kernels import (
    flash_attn_block_size_ok,
    gather_kv,
    paged_attention,
    paged_attention_reference,
    select_paged_backend,
)
from hf_vkv.kv_records import PagedKV

#: Where the Triton tests run: compiled on a GPU when there is one, else interpreted on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _import_triton_paged():
    """Import the Triton module, in interpreter mode when there is no GPU. The mode is fixed when
    the kernels are defined (first import), so the variable is set only around that import and
    restored after it: other tests of the session keep their own triton mode."""
    if DEVICE.type == "cuda" or "hf_vkv.attention.triton_paged" in sys.modules:
        import hf_vkv.attention.triton_paged as module
        return module
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        import hf_vkv.attention.triton_paged as module
    finally:
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
    return module


try:
    triton_paged = _import_triton_paged()
except ImportError as exc:  # pragma: no cover - depends on the install
    triton_paged = None
    TRITON_SKIP: str | None = f"triton is not importable ({exc}); scripts/install.sh installs triton==3.9.0"
else:
    TRITON_SKIP = None
    if DEVICE.type == "cpu" and not triton_paged.INTERPRETED:
        TRITON_SKIP = ("hf_vkv.attention.triton_paged was imported before this module without TRITON_INTERPRET=1 "
                       "and there is no GPU: its kernels cannot run here")

needs_triton = pytest.mark.skipif(TRITON_SKIP is not None, reason=TRITON_SKIP or "")


def launch(case: "Case", **tiling) -> torch.Tensor:
    """Run the Triton kernel on ``DEVICE`` with explicit tiling; the result comes back to the CPU."""
    moved = case.to(DEVICE)
    return triton_paged.launch_paged_attention(*moved.args(), **moved.kwargs(), **tiling).cpu()


GARBAGE = (-1, 2**31 - 1)


@pytest.fixture(autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@dataclasses.dataclass
class Case:
    """One paged-attention problem and the plain tensors it was built from."""

    query: torch.Tensor  # [B, Hq, q, D], a transposed view of [B, q, Hq, D] (as attention modules pass it)
    key_cache: torch.Tensor  # [N, bs, Hkv, D], strided view of the store
    value_cache: torch.Tensor
    block_tables: torch.Tensor  # int32 [B, max_blocks]
    keys: torch.Tensor  # [B, Hkv, kv_offset + kv_len, D]: row b's token at absolute position p
    values: torch.Tensor
    kv_offset: int
    kv_len: int
    lengths: list[int]  # L_b
    kv_lens: torch.Tensor | None
    mask: torch.Tensor | None  # bool [B, 1, q, kv_len]
    scale: float

    def kwargs(self) -> dict:
        return dict(scale=self.scale, mask=self.mask)

    def kv(self) -> PagedKV:
        return PagedKV(self.key_cache, self.value_cache, self.block_tables, self.kv_offset, self.kv_len, self.kv_lens)

    def args(self) -> tuple:
        return self.query, self.kv()

    def to(self, device: torch.device) -> "Case":
        """The kernel inputs on ``device``; the caches stay views of one store (strides kept)."""
        if device.type == "cpu":
            return self
        store = self.key_cache.as_strided((self.key_cache.untyped_storage().nbytes()
                                           // self.key_cache.element_size(),), (1,), 0).to(device)
        caches = [store.as_strided(c.shape, c.stride(), c.storage_offset()) for c in (self.key_cache, self.value_cache)]
        move = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        move.update(query=self.query.to(device), key_cache=caches[0], value_cache=caches[1],
                    block_tables=self.block_tables.to(device),
                    kv_lens=None if self.kv_lens is None else self.kv_lens.to(device),
                    mask=None if self.mask is None else self.mask.to(device))
        return Case(**move)


def padding_mask(*, pads: list[int], lengths: list[int], q: int, kv_offset: int, kv_len: int,
                 window: int | None = None) -> torch.Tensor:
    """The bool mask transformers' ``sdpa_mask`` makes for left padding: row ``b``'s absolute
    positions ``< pads[b]`` are padding; query ``i`` sits at ``kv_offset + L_b - q + i`` and sees the
    non-padding tokens at or before it (within ``window`` of it, if given)."""
    batch = len(pads)
    cols = kv_offset + torch.arange(kv_len)
    mask = torch.zeros(batch, 1, q, kv_len, dtype=torch.bool)
    for b in range(batch):
        qpos = kv_offset + lengths[b] - q + torch.arange(q)
        allowed = (cols[None, :] >= pads[b]) & (cols[None, :] <= qpos[:, None])
        if window is not None:
            allowed &= qpos[:, None] - cols[None, :] < window
        mask[b, 0] = allowed
    return mask


def make_case(*, batch: int = 3, kv_heads: int = 2, group: int = 3, q: int = 1, kv_len: int = 37,
              kv_offset: int = 0, block_size: int = 16, head_dim: int = 16, ragged: bool = False,
              padded: bool = False, window: int | None = None, dtype: torch.dtype = torch.float32,
              seed: int = 0, lengths: list[int] | None = None, pads: list[int] | None = None) -> Case:
    """A random problem. ``ragged``: rows of lengths ``[kv_len, kv_len // 2, 1, kv_len - 3]`` (or
    ``lengths``) passed as ``kv_lens``; ``padded``: a left-padding mask (pads ``pads``, default
    ``0, 3, 6`` tokens after ``kv_offset``, capped by the row) with an optional sliding ``window``."""
    gen = torch.Generator().manual_seed(seed)
    total = kv_offset + kv_len
    per_row = math.ceil(total / block_size)
    num_blocks = batch * per_row + 3  # a few blocks no row uses
    layers, layer = 3, 1
    store = torch.randn(num_blocks, block_size, layers, 2, kv_heads, head_dim, generator=gen).to(dtype)
    keys = torch.randn(batch, kv_heads, total, head_dim, generator=gen).to(dtype)
    values = torch.randn(batch, kv_heads, total, head_dim, generator=gen).to(dtype)
    if lengths is None:
        lengths = [kv_len, max(1, kv_len // 2), 1, kv_len - 3][:batch] if ragged else [kv_len] * batch
    perm = torch.randperm(num_blocks, generator=gen)[: batch * per_row].view(batch, per_row)
    tables = torch.empty(batch, per_row + 2, dtype=torch.int32)  # two spare columns, never read
    for b in range(batch):
        for j in range(per_row + 2):
            end = min((j + 1) * block_size, kv_offset + lengths[b])
            if j >= per_row or (j + 1) * block_size <= kv_offset or j * block_size >= end:
                tables[b, j] = GARBAGE[(b + j) % 2]
                continue
            tables[b, j] = int(perm[b, j])
            for p in range(j * block_size, end):
                store[perm[b, j], p - j * block_size, layer, 0] = keys[b, :, p]
                store[perm[b, j], p - j * block_size, layer, 1] = values[b, :, p]
    query = torch.randn(batch, q, kv_heads * group, head_dim, generator=gen).to(dtype).transpose(1, 2)
    mask = None
    if padded:
        if pads is None:
            pads = [kv_offset + (3 * b) % max(1, min(lengths[b], 7)) for b in range(batch)]  # row 0 unpadded
        mask = padding_mask(pads=pads, lengths=lengths, q=q, kv_offset=kv_offset, kv_len=kv_len, window=window)
    kv_lens = torch.tensor(lengths, dtype=torch.int32) if ragged else None
    return Case(query, store[:, :, layer, 0], store[:, :, layer, 1], tables, keys, values, kv_offset, kv_len,
                lengths, kv_lens, mask, head_dim**-0.5)


def naive_attention(case: Case) -> torch.Tensor:
    """Row by row in float64: slice the row's contiguous K/V, repeat them per query head, sdpa with
    an explicit mask, zeros where a query row attends nothing. ``[B, Hq, q, D]`` float64."""
    batch, q_heads, q, head_dim = case.query.shape
    group = q_heads // case.keys.shape[1]
    out = torch.zeros(batch, q_heads, q, head_dim, dtype=torch.float64)
    for b, length in enumerate(case.lengths):
        if length == 0:
            continue
        span = slice(case.kv_offset, case.kv_offset + length)
        k = case.keys[b, :, span].double().repeat_interleave(group, 0)  # [Hq, L, D]
        v = case.values[b, :, span].double().repeat_interleave(group, 0)
        if case.mask is None:
            qpos = case.kv_offset + length - q + torch.arange(q)
            allowed = (case.kv_offset + torch.arange(length))[None, :] <= qpos[:, None]
        else:
            allowed = case.mask[b, 0, :, :length]
        o = F.scaled_dot_product_attention(case.query[b].double(), k, v, attn_mask=allowed, scale=case.scale)
        out[b] = o.masked_fill(~allowed.any(-1)[None, :, None], 0.0)
    return out


# ---------------------------------------------------------------------------------------------
# The reference and gather_kv


@pytest.mark.parametrize("block_size", [1, 7, 16])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("kv_offset,ragged", [(0, False), (19, True)], ids=["full", "offset+ragged"])
@pytest.mark.parametrize("q", [1, 5, 37], ids=["decode", "prefill", "first-prefill"])  # kv_len is 37
def test_reference_matches_naive_per_row_sdpa(block_size, padded, kv_offset, ragged, q):
    case = make_case(block_size=block_size, padded=padded, kv_offset=kv_offset, ragged=ragged, q=q)
    out = paged_attention_reference(*case.args(), **case.kwargs())
    assert out.shape == case.query.shape and out.dtype == case.query.dtype
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 5, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_kv_is_an_exact_copy(block_size, dtype):
    case = make_case(block_size=block_size, kv_offset=11, dtype=dtype)
    keys, values = gather_kv(PagedKV(case.key_cache, case.value_cache, case.block_tables, 11, 37))
    assert keys.is_contiguous() and values.is_contiguous() and keys.dtype == dtype
    assert torch.equal(keys, case.keys[:, :, 11:]) and torch.equal(values, case.values[:, :, 11:])
    empty, _ = gather_kv(PagedKV(case.key_cache, case.value_cache, case.block_tables, 48, 0))
    assert empty.shape == (3, 2, 0, 16)


def test_gather_and_reference_on_caches_whose_blocks_do_not_flatten():
    """Blocks with spare token room (``stride(0) != block_size * stride(1)``) take the advanced-index path."""
    case = make_case(block_size=7, kv_offset=9, q=3, padded=True)
    caches = []
    for cache in (case.key_cache, case.value_cache):
        roomy = torch.randn(cache.shape[0], 9, *cache.shape[2:])
        roomy[:, :7] = cache
        caches.append(roomy[:, :7])
    assert caches[0].stride(0) != 7 * caches[0].stride(1)
    keys, values = gather_kv(PagedKV(*caches, case.block_tables, 9, 37))
    assert torch.equal(keys, case.keys[:, :, 9:]) and torch.equal(values, case.values[:, :, 9:])
    roomy_case = dataclasses.replace(case, key_cache=caches[0], value_cache=caches[1])
    out = paged_attention_reference(*roomy_case.args(), **roomy_case.kwargs())
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_hand_built_padding_mask_is_what_transformers_makes():
    masking_utils = pytest.importorskip("transformers.masking_utils")
    pads, lengths, q, kv_offset, kv_len = [0, 3, 11], [12, 12, 12], 4, 2, 12
    attention_mask = torch.arange(kv_offset + kv_len)[None, :] >= torch.tensor(pads)[:, None]  # [B, positions]
    try:
        theirs = masking_utils.sdpa_mask(3, q, kv_len, q_offset=kv_offset + kv_len - q, kv_offset=kv_offset,
                                         attention_mask=attention_mask, allow_is_causal_skip=False)
    except TypeError as exc:
        pytest.skip(f"this transformers' sdpa_mask has another signature: {exc}")
    ours = padding_mask(pads=pads, lengths=lengths, q=q, kv_offset=kv_offset, kv_len=kv_len)
    assert torch.equal(theirs, ours)
    assert not ours[2, 0, 0].any() and ours[2, 0, 1].any()  # row 2: query 0 (position 10) is padding itself


# ---------------------------------------------------------------------------------------------
# Triton (interpreted) against the reference


@needs_triton
@pytest.mark.parametrize("block_size", [1, 7, 16, 64])
@pytest.mark.parametrize("group", [1, 3, 8], ids=lambda g: f"gqa{g}")
@pytest.mark.parametrize("q", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
@pytest.mark.parametrize("scenario", ["full", "window"])
def test_triton_matches_reference(block_size, group, q, padded, scenario):
    window = scenario == "window"
    case = make_case(block_size=block_size, group=group, q=q, padded=padded, ragged=window,
                     kv_offset=2 * block_size + 3 if window else 0, window=9 if window and padded else None,
                     kv_heads=2 if group < 8 else 1, seed=block_size * 7 + group)
    ref = paged_attention_reference(*case.args(), **case.kwargs())
    out = launch(case, block_m=16, block_n=16, num_splits=1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("num_splits", [2, 5])
@pytest.mark.parametrize("q", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("padded", [False, True], ids=["causal", "padded"])
def test_triton_split_kv_matches_reference(num_splits, q, padded):
    """Flash-decoding: the KV range split over programs, partial results combined."""
    case = make_case(block_size=7, group=3, q=q, padded=padded, ragged=True, kv_offset=10, kv_len=70, seed=num_splits)
    ref = paged_attention_reference(*case.args(), **case.kwargs())
    out = launch(case, block_n=16, num_splits=num_splits)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("head_dim", [24, 64])
@pytest.mark.parametrize("q", [1, 37], ids=["decode", "first-prefill"])
def test_triton_default_tiling_and_head_dims(head_dim, q):
    """The public entry point with its default tiles; head_dim 24 is not a power of two, and
    q == kv_len is a first prefill (no past)."""
    case = make_case(block_size=16, group=3, q=q, head_dim=head_dim, kv_len=37, padded=q > 1)
    ref = paged_attention_reference(*case.args(), **case.kwargs())
    moved = case.to(DEVICE)
    out = triton_paged.paged_attention_triton(*moved.args(), **moved.kwargs()).cpu()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


@needs_triton
@pytest.mark.parametrize("dtype,atol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)], ids=["fp16", "bf16"])
@pytest.mark.parametrize("q", [1, 6], ids=["decode", "prefill"])
@pytest.mark.parametrize("block_size", [7, 16])
def test_triton_half_precision(dtype, atol, q, block_size):
    """Half-precision caches, fp32 accumulation: against the reference run in fp32 on the same
    (already rounded) values. Under the interpreter bf16 tiles are widened before each dot (see
    ``launch_paged_attention``), so bf16 here checks the loads, stores and paging, not bf16 dots."""
    case = make_case(block_size=block_size, group=3, q=q, padded=True, ragged=True, kv_offset=9, dtype=dtype)
    wide = dataclasses.replace(case, query=case.query.float(), key_cache=case.key_cache.float(),
                               value_cache=case.value_cache.float())
    ref = paged_attention_reference(*wide.args(), **wide.kwargs())
    out = launch(case, block_n=16, num_splits=2 if q == 1 else 1)
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=atol, rtol=0)


# ---------------------------------------------------------------------------------------------
# Rows with nothing to attend to


def empty_rows_case() -> Case:
    """Row 0 normal; row 1's first two queries are padding (fully masked); row 2 has length 0."""
    return make_case(batch=3, group=3, q=4, kv_len=20, block_size=5, ragged=True, lengths=[20, 20, 0],
                     padded=True, pads=[0, 18, 0], seed=3)


def assert_empty_rows_zero(out: torch.Tensor, case: Case) -> None:
    assert torch.isfinite(out).all()
    assert torch.equal(out[1, :, :2], torch.zeros_like(out[1, :, :2]))
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    assert out[0].abs().sum() > 0 and out[1, :, 2:].abs().sum() > 0


def test_reference_returns_zeros_for_empty_rows():
    case = empty_rows_case()
    out = paged_attention_reference(*case.args(), **case.kwargs())
    assert_empty_rows_zero(out, case)
    torch.testing.assert_close(out.double(), naive_attention(case), atol=1e-5, rtol=1e-5)


def test_reference_returns_zeros_where_sdpa_gives_nan(monkeypatch):
    """torch 2.13's CPU sdpa already returns zeros for a fully masked row, but other versions and
    backends return NaN: the reference must not depend on which."""
    real_sdpa = F.scaled_dot_product_attention

    def nan_sdpa(query, key, value, *, attn_mask, **kwargs):
        out = real_sdpa(query, key, value, attn_mask=attn_mask, **kwargs)
        return out.masked_fill(~attn_mask.any(-1, keepdim=True), float("nan"))

    monkeypatch.setattr(F, "scaled_dot_product_attention", nan_sdpa)
    case = empty_rows_case()
    out = paged_attention_reference(*case.args(), **case.kwargs())
    assert_empty_rows_zero(out, case)


@needs_triton
@pytest.mark.parametrize("num_splits", [1, 3])
def test_triton_returns_zeros_for_empty_rows(num_splits):
    case = empty_rows_case()
    out = launch(case, block_n=16, num_splits=num_splits)
    assert_empty_rows_zero(out, case)
    torch.testing.assert_close(out, paged_attention_reference(*case.args(), **case.kwargs()), atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# Dispatch and errors


def test_dispatcher_on_cpu_runs_the_reference():
    case = make_case(block_size=7, group=3, q=3, padded=True, kv_offset=8)
    assert select_paged_backend(case.query, case.key_cache, kv_offset=8, mask=case.mask) == "reference"
    assert torch.equal(paged_attention(*case.args(), **case.kwargs()),
                       paged_attention_reference(*case.args(), **case.kwargs()))


def test_flash_attn_block_size_constraint():
    assert [b for b in (1, 16, 64, 128, 255, 256, 257, 512, 768) if flash_attn_block_size_ok(b)] == [256, 512, 768]


def _bad(case: Case, **changes):
    """The case's arguments with some replaced (``query``, a field of its ``PagedKV``, ``scale`` or
    ``mask``): ``(query, kv, keywords)``."""
    fields = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                  block_tables=case.block_tables, kv_offset=case.kv_offset, kv_len=case.kv_len,
                  kv_lens=case.kv_lens, **case.kwargs())
    fields.update(changes)
    kv = PagedKV(*(fields.pop(k) for k in ("key_cache", "value_cache", "block_tables", "kv_offset", "kv_len",
                                           "kv_lens")))
    return fields.pop("query"), kv, fields


BAD_INPUTS = [
    ("block_tables int64", lambda c: _bad(c, block_tables=c.block_tables.long()), ValueError, "block_tables"),
    ("short table", lambda c: _bad(c, block_tables=c.block_tables[:, :2]), ValueError, "kv_offset + kv_len"),
    ("query dtype", lambda c: _bad(c, query=c.query.double()), TypeError, "query has dtype"),
    ("head_dim", lambda c: _bad(c, query=c.query[..., :8]), ValueError, "head_dim"),
    ("heads", lambda c: _bad(c, query=c.query[:, :5]), ValueError, "multiple of the caches' kv_heads"),
    ("mask dtype", lambda c: _bad(c, mask=torch.ones(3, 1, 1, 37)), TypeError, "mask"),
    ("mask shape", lambda c: _bad(c, mask=torch.ones(3, 1, 1, 36, dtype=torch.bool)), ValueError, "mask"),
    ("kv_lens too long", lambda c: _bad(c, kv_lens=torch.tensor([37, 38, 1], dtype=torch.int32)), ValueError,
     "kv_lens"),
    ("kv_lens int64", lambda c: _bad(c, kv_lens=torch.tensor([37, 3, 1])), ValueError, "kv_lens"),
    ("kv_offset", lambda c: _bad(c, kv_offset=-1), ValueError, "kv_offset"),
    ("scale", lambda c: _bad(c, scale=float("nan")), ValueError, "scale"),
    ("strided head_dim", lambda c: _bad(c, key_cache=c.key_cache.transpose(2, 3), value_cache=c.value_cache.transpose(
        2, 3)), ValueError, "stride(-1) == 1"),
    ("block out of pool", lambda c: _bad(c, block_tables=torch.where(c.block_tables == c.block_tables[0, 0],
                                                                     10**6, c.block_tables).int()),
     ValueError, "caches hold blocks"),
]


@pytest.mark.parametrize("make_args,error,match", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_typed_errors(make_args, error, match):
    case = make_case(block_size=16)
    query, kv, keywords = make_args(case)
    kernels = [paged_attention_reference, paged_attention]
    if TRITON_SKIP is None:
        kernels.append(triton_paged.paged_attention_triton)
    for kernel in kernels:
        with pytest.raises(error, match=re.escape(match)):
            kernel(query, kv, **keywords)
    # the caches were not touched: the same call with good arguments still gives the naive result
    torch.testing.assert_close(paged_attention_reference(*case.args(), **case.kwargs()).double(),
                               naive_attention(case), atol=1e-5, rtol=1e-5)


@needs_triton
def test_triton_refuses_cpu_tensors_when_compiled(monkeypatch):
    case = make_case(block_size=16)
    monkeypatch.setattr(triton_paged, "INTERPRETED", False)
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        triton_paged.paged_attention_triton(*case.args(), **case.kwargs())
