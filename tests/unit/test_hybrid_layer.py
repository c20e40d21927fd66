"""Hybrid layers (Falcon-H1's ``"hybrid"``, a ``"hybrid_sliding"`` variant) against DynamicCache.

The same synthetic states go into a ``VKVCache`` and a ``DynamicCache`` built from one config; after
every row operation both must hold the same K/V, conv and recurrent states, and report the same
lengths, mask sizes and layer kinds. A permutation of order 3 as ``beam_idx`` shows that one
``reorder_cache`` moves the pages and the linear state exactly once each.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from models import RECORDS_RECURRENT
from transformers import FalconH1Config, Qwen3NextConfig
from transformers.cache_utils import Cache, DynamicCache

import hf_vkv
from hf_vkv.cache.hybrid import LinearState, RecurrentRollbackError, VKVHybridLayer, VKVHybridSlidingLayer

ROWS, KV_HEADS, HEAD_DIM, CONV_DIM, KERNEL = 3, 1, 16, 8, 4
CYCLE = [1, 2, 0]  # order 3: applied twice it differs from once
_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
              num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, vocab_size=64, max_position_embeddings=64)
#: Falcon-H1 (every layer "hybrid"), and a config whose layer_types can say "hybrid_sliding"
#: (no model of transformers 5.17 has one; the cache only reads the types and the window).
CONFIGS = {
    "hybrid": lambda: FalconH1Config(**_SIZES, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1,
                                     mamba_d_state=8, mamba_d_conv=KERNEL),
    "hybrid_sliding": lambda: Qwen3NextConfig(**_SIZES, layer_types=["hybrid_sliding", "hybrid"], sliding_window=4),
}


def _step(caches: tuple[Cache, ...], tokens: int, *, seed: int, recurrent: bool = True) -> None:
    """Write ``tokens`` tokens of random K/V ``[B, H, q, D]``, conv ``[B, C, q]`` and (if
    ``recurrent``) recurrent ``[B, 4, 8, 8]`` states into every layer of each cache (the same
    values in each)."""
    g = torch.Generator().manual_seed(seed)
    for layer in range(len(caches[0].layers)):
        k, v = (torch.randn(ROWS, KV_HEADS, tokens, HEAD_DIM, generator=g) for _ in range(2))
        conv = torch.randn(ROWS, CONV_DIM, tokens, generator=g)
        state = torch.randn(ROWS, 4, 8, 8, generator=g)
        for cache in caches:
            cache.update(k, v, layer)
            cache.update_conv_state(conv, layer, conv_kernel_size=KERNEL)
            if recurrent:
                cache.update_recurrent_state(state, layer)


def _pair(kind: str = "hybrid") -> tuple[hf_vkv.VKVCache, DynamicCache]:
    config = CONFIGS[kind]()
    return hf_vkv.VKVCache(config), DynamicCache(config=config)


def assert_same(got: hf_vkv.VKVCache, ref: DynamicCache) -> None:
    """Same K/V, linear states, lengths, mask sizes and layer kinds."""
    assert got.is_linear == ref.is_linear and got.is_sliding == ref.is_sliding
    assert got.is_croppable == ref.is_croppable and got.get_max_length() == ref.get_max_length()
    assert got.get_seq_length() == ref.get_seq_length()
    for idx, (mine, theirs) in enumerate(zip(got.layers, ref.layers, strict=True)):
        assert got.get_mask_sizes(1, idx) == ref.get_mask_sizes(1, idx)
        assert got.has_previous_state(idx) == ref.has_previous_state(idx)
        assert mine.record_past == theirs.record_past  # what the models read (Cache.is_recording_past on 5.23)
        if theirs.get_seq_length():
            assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)
        for name in ("conv_states", "recurrent_states"):
            a, b = getattr(mine, name)[0], getattr(theirs, name)[0]
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"layer {idx} {name}"
    got.check_invariants()


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_layers_are_transformers_kinds_with_kv_in_groups(kind: str) -> None:
    got, ref = _pair(kind)
    for mine, theirs in zip(got.layers, ref.layers, strict=True):
        assert isinstance(mine, type(theirs)) and isinstance(mine.linear, LinearState)
    assert (got.stats().vkv_layers, got.stats().transformers_layers) == (2, 2)
    assert sum(len(g.members) for g in got.groups) == 2
    _step((got, ref), 5, seed=0)
    assert_same(got, ref)
    _step((got, ref), 1, seed=1)
    assert_same(got, ref)


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_reorder_moves_pages_and_linear_state_once(kind: str) -> None:
    got, ref = _pair(kind)
    _step((got, ref), 5, seed=0)
    beam_idx = torch.tensor(CYCLE, dtype=torch.int32)
    got.reorder_cache(beam_idx)
    ref.reorder_cache(beam_idx)
    assert_same(got, ref)
    _step((got, ref), 1, seed=1)  # a decode step after the reorder writes where the rows now are
    assert_same(got, ref)


def test_crop_after_recording_rolls_back_kv_and_conv_state() -> None:
    got, ref = _pair()
    _step((got, ref), 5, seed=0, recurrent=False)  # conv state only (as LFM2's conv layers): croppable
    for cache in (got, ref):
        cache.activate_past_recording()
    _step((got, ref), 3, seed=1, recurrent=False)
    assert got.is_croppable and ref.is_croppable
    assert_same(got, ref)
    for cache in (got, ref):
        cache.crop(-2)
    assert_same(got, ref)
    assert got.get_seq_length() == 6
    for cache in (got, ref):
        cache.crop(0)
    assert_same(got, ref)


def test_cutting_a_recurrent_state_back_is_refused() -> None:
    got, ref = _pair()
    _step((got, ref), 5, seed=0)
    # transformers' answer: False before 5.25; from 5.25 True (croppable while recording, below)
    assert got.is_croppable == ref.is_croppable == RECORDS_RECURRENT
    with pytest.raises(ValueError, match=r"serves prefixes of 5..5 tokens .*recurrent state cannot be cut back"):
        got.fork(3)  # (DynamicCache's crop would trim the conv state and keep the recurrent state of 5 tokens)
    with pytest.raises(RecurrentRollbackError, match="cannot be cut back"):
        twin = got.fork()
        twin.activate_past_recording()
        twin.crop(-2)
    assert_same(got, ref)  # the refused fork left the cache as it was
    got.activate_past_recording()
    ref.activate_past_recording()
    got.crop(0)  # trimming the conv state back to its kernel removes no token
    ref.crop(0)
    assert_same(got, ref)


@pytest.mark.skipif(not RECORDS_RECURRENT, reason="transformers < 5.25 records no past recurrent states")
def test_recorded_recurrent_states_roll_back_as_dynamic_cache() -> None:
    """Speculative decoding on a recurrent model (transformers >= 5.25): the states recorded since
    ``activate_past_recording`` put the layer back as DynamicCache's; a crop past them is refused
    (:class:`RecurrentRollbackError`, before anything changes), where DynamicCache's layer fails
    with an IndexError or restores a state of the wrong length."""
    got, ref = _pair()
    _step((got, ref), 5, seed=0)
    for cache in (got, ref):
        cache.activate_past_recording(recurrent_states_to_keep=3)
    for seed in (1, 2, 3):
        _step((got, ref), 1, seed=seed)
    assert_same(got, ref)
    with pytest.raises(RecurrentRollbackError, match="cannot be cut back past the states recorded"):
        got.crop(-4)  # three recorded: one token more than can be restored
    assert_same(got, ref)  # nothing changed
    assert got.get_seq_length() == 8
    for cache in (got, ref):
        cache.crop(-2)
    assert_same(got, ref)
    assert got.get_seq_length() == 6
    with pytest.raises(RecurrentRollbackError):
        got.crop(-1)  # the crop dropped the records
    assert_same(got, ref)


def test_crop_without_recording_is_refused_as_by_transformers() -> None:
    got, ref = _pair()
    _step((got, ref), 5, seed=0)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        ref.crop(-1)
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        got.crop(-1)


def test_reset_forgets_tokens_and_linear_state() -> None:
    got, _ = _pair()
    _step((got,), 5, seed=0)
    got.reset()
    assert got.get_seq_length() == 0  # (transformers 5.17's DynamicLayer.reset zeroes its tokens but keeps them)
    for idx, layer in enumerate(got.layers):
        assert not got.has_previous_state(idx)
        assert not layer.conv_states[0].any() and not layer.recurrent_states[0].any()
    _, fresh = _pair()
    _step((got, fresh), 4, seed=2)  # refilled from scratch, as a new DynamicCache
    assert_same(got, fresh)


def test_select_and_repeat_move_linear_state_with_the_pages() -> None:
    got, _ = _pair()
    ref, _ = _pair()
    _step((got, ref), 5, seed=0)
    before = [(layer.conv_states[0].clone(), layer.recurrent_states[0].clone()) for layer in got.layers]
    got.batch_select_indices(torch.tensor([2, 0]))
    got.batch_repeat_interleave(2)
    rows = torch.tensor([2, 2, 0, 0])
    for layer, twin, (conv, recurrent) in zip(got.layers, ref.layers, before, strict=True):
        assert torch.equal(layer.conv_states[0], conv[rows])
        assert torch.equal(layer.recurrent_states[0], recurrent[rows])
        assert torch.equal(layer.keys, twin.keys[rows])
    got.check_invariants()


def test_fork_owns_its_linear_state() -> None:
    got, ref = _pair()
    _step((got, ref), 5, seed=0)
    twin = copy.deepcopy(got)
    _step((got,), 1, seed=1)  # in-place writes to the original's states ...
    assert_same(twin, ref)  # ... leave the fork's alone
    for a, b in zip(got.layers, twin.layers, strict=True):
        assert a.linear is not b.linear and a.group is not b.group


@pytest.mark.parametrize("op", ["reorder_cache", "crop", "reset", "batch_select_indices"])
def test_row_operations_on_one_layer_are_refused(op: str) -> None:
    got, _ = _pair()
    layer = got.layers[0]
    assert isinstance(layer, VKVHybridLayer) and not isinstance(layer, VKVHybridSlidingLayer)
    with pytest.raises(RuntimeError, match="VKVCache"):
        getattr(layer, op)(torch.tensor([0]))


def test_a_prefix_file_refuses_a_cache_with_recurrent_state(tmp_path: Any) -> None:
    """A file holds key/value states only: saving a hybrid cache would lose its linear state."""
    got, _ = _pair()
    _step((got,), 5, seed=0)
    with pytest.raises(ValueError, match=r"keep recurrent or linear-attention state"):
        hf_vkv.save_prefix(tmp_path / "prefix.safetensors", got, list(range(5)))
    assert not (tmp_path / "prefix.safetensors").exists()
