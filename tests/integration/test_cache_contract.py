"""Row operations and reporting of a VKVCache compared with DynamicCache on the same forwards.

* ``batch_select_indices`` takes whatever indexes a tensor's batch dimension, a tuple included
  (``DynamicLayer`` does ``keys[indices]``), an empty one too (no rows: length 0);
* ``stats()`` and ``repr()`` say how many layers vkv stores and how many stay with transformers
  (Jamba: one attention layer in vkv, one Mamba layer in transformers' ``LinearAttentionLayer``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from breadth_models import prompts, tiny
from transformers.cache_utils import DynamicCache

import hf_vkv
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration


def _filled(cache: Any, arch: str) -> Any:
    with torch.no_grad():
        tiny(arch)(**prompts(4, 8), **{cache_kwarg(): cache}, use_cache=True)
    return cache


def test_batch_select_indices_takes_a_tuple() -> None:
    model = tiny("llama")
    expected = _filled(DynamicCache(config=model.config), "llama")
    got = _filled(hf_vkv.VKVCache(model.config), "llama")
    expected.batch_select_indices((0, 2))
    got.batch_select_indices((0, 2))
    for mine, theirs in zip(got.layers, expected.layers, strict=True):
        assert torch.equal(mine.keys, theirs.keys)
        assert torch.equal(mine.values, theirs.values)


def test_selecting_no_rows_leaves_no_tokens_as_in_dynamic_cache() -> None:
    """``batch_select_indices`` of an empty index: every layer's tensors are empty, and the length
    is 0 as ``DynamicLayer`` says (vkv said the old length)."""
    model = tiny("llama")
    expected = _filled(DynamicCache(config=model.config), "llama")
    got = _filled(hf_vkv.VKVCache(model.config), "llama")
    for cache in (expected, got):
        cache.batch_select_indices(torch.tensor([], dtype=torch.long))
    assert got.get_seq_length() == expected.get_seq_length() == 0
    for mine, theirs in zip(got.layers, expected.layers, strict=True):
        assert mine.keys.shape == theirs.keys.shape and mine.keys.shape[0] == 0
    got.check_invariants()


def test_stats_and_repr_count_layers() -> None:
    model = tiny("jamba")
    cache = _filled(hf_vkv.VKVCache(model.config), "jamba")
    stats = cache.stats()
    assert (stats.vkv_layers, stats.transformers_layers) == (1, 1)
    text = repr(cache)
    assert "vkv_layers=1" in text and "transformers_layers=1" in text, text
