"""Assisted decoding and prompt-lookup decoding (both crop the cache) with a VKV cache.

Token-identical to DynamicCache with an encoder-decoder model (BART: the self-attention cache of
an ``EncoderDecoderCache`` is a VKVCache) and a sliding-window model (Mistral, window 6 < the
generated length). And a sliding layer that records its past (what assisted decoding turns on)
shows every recorded token in ``.keys``, as ``DynamicSlidingWindowLayer`` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from breadth_models import WINDOW, prompts, tiny
from models import needs_sliding_rollback
from transformers.cache_utils import DynamicCache

import hf_vkv

pytestmark = pytest.mark.integration

NEW = 12  # prompt 10 + 12 new tokens: twice past Mistral's window

_CROP_XFAIL = pytest.mark.xfail(
    strict=True, raises=TypeError,
    reason="cache: EncoderDecoderCache.crop/batch ops accept only a DynamicCache self-attention cache "
           "('crop is only defined for dynamic cache')")


def _speculative(kind: str, arch: str) -> dict[str, Any]:
    if kind == "assisted":
        return {"assistant_model": tiny(arch, depth=1)}
    return {"prompt_lookup_num_tokens": 3}


@pytest.mark.parametrize("kind", ["assisted", "prompt_lookup"])
@pytest.mark.parametrize("arch", [
    pytest.param("bart", marks=_CROP_XFAIL),
    pytest.param("mistral", marks=needs_sliding_rollback),
])
def test_speculative_decoding_identical(arch: str, kind: str) -> None:
    model = tiny(arch)
    inputs = prompts(1, 10, seed=3)
    extra = _speculative(kind, arch)
    ref = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, **extra)
    got = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True,
                         cache_implementation="vkv", **extra)
    assert torch.equal(ref.sequences, got.sequences), f"{ref.sequences}\n{got.sequences}"
    past = got.past_key_values
    past = getattr(past, "self_attention_cache", past)
    assert isinstance(past, hf_vkv.VKVCache)
    past.check_invariants()


def _recording_layer0_keys(cache: Any, model: Any) -> torch.Tensor:
    cache.activate_past_recording()
    ids = prompts(1, WINDOW + 4, seed=4)["input_ids"]
    with torch.no_grad():
        model(input_ids=ids[:, :-2], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, -2:-1], past_key_values=cache, use_cache=True)
        model(input_ids=ids[:, -1:], past_key_values=cache, use_cache=True)
    return cache.layers[0].keys


@needs_sliding_rollback
@pytest.mark.xfail(strict=True, raises=AssertionError,
                   reason="cache: a recording VKVSlidingLayer's .keys shows only the window, "
                          "DynamicSlidingWindowLayer shows every recorded token")
def test_recording_sliding_layer_shows_every_recorded_token() -> None:
    model = tiny("mistral")
    expected = _recording_layer0_keys(DynamicCache(config=model.config), model)
    got = _recording_layer0_keys(hf_vkv.VKVCache(model.config), model)
    assert expected.shape[2] == WINDOW + 4  # the reference recorded everything
    assert got.shape == expected.shape, f"{tuple(got.shape)} vs {tuple(expected.shape)}"
    assert torch.equal(got, expected)
