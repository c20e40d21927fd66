"""Assisted decoding and prompt-lookup decoding (both crop the cache) with a VKV cache.

Token-identical to DynamicCache with an encoder-decoder model (BART: the self-attention cache of
an ``EncoderDecoderCache`` is a VKVCache) and sliding-window models (Mistral, and Gemma 3 with
sliding and full layers, window 6 < the generated length). And a sliding layer that records its past (what assisted decoding turns on)
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
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration

NEW = 12  # prompt 10 + 12 new tokens: twice past Mistral's window

def _speculative(kind: str, arch: str) -> dict[str, Any]:
    if kind == "assisted":
        # a shallower model (other weights); Gemma 3's layer types fix its depth at two
        return {"assistant_model": tiny(arch, depth=2 if arch == "gemma3" else 1)}
    return {"prompt_lookup_num_tokens": 3}


@pytest.mark.parametrize("kind", ["assisted", "prompt_lookup"])
@pytest.mark.parametrize("arch", [
    "bart",
    pytest.param("mistral", marks=needs_sliding_rollback),
    pytest.param("gemma3", marks=needs_sliding_rollback),
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
        model(input_ids=ids[:, :-2], **{cache_kwarg(): cache}, use_cache=True)
        model(input_ids=ids[:, -2:-1], **{cache_kwarg(): cache}, use_cache=True)
        model(input_ids=ids[:, -1:], **{cache_kwarg(): cache}, use_cache=True)
    return cache.layers[0].keys


@needs_sliding_rollback
def test_recording_sliding_layer_shows_every_recorded_token() -> None:
    model = tiny("mistral")
    expected = _recording_layer0_keys(DynamicCache(config=model.config), model)
    got = _recording_layer0_keys(hf_vkv.VKVCache(model.config), model)
    assert expected.shape[2] == WINDOW + 4  # the reference recorded everything
    assert got.shape == expected.shape, f"{tuple(got.shape)} vs {tuple(expected.shape)}"
    assert torch.equal(got, expected)


def _layer_contract_run(cache: Any, model: Any) -> list[tuple[str, list[torch.Tensor]]]:
    """What transformers does to a cache's layers one by one: ``activate_past_recording()`` on each
    layer that has it (``Cache.activate_past_recording``), a crop back, then ``record_past = False``
    on each layer (what generate does before handing a cache back) and one more step. Returns each
    stage's ``keys`` of every layer."""
    ids = prompts(1, 7 * WINDOW + 3, seed=5)["input_ids"]
    seen = []
    with torch.no_grad():
        model(input_ids=ids[:, :5], **{cache_kwarg(): cache}, use_cache=True)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording"):
                layer.activate_past_recording()
        model(input_ids=ids[:, 5:-1], **{cache_kwarg(): cache}, use_cache=True)
        seen.append(("recorded", [layer.keys for layer in cache.layers]))
        cache.crop(-3)
        seen.append(("cropped", [layer.keys for layer in cache.layers]))
        for layer in cache.layers:
            if hasattr(layer, "record_past"):
                layer.record_past = False
        model(input_ids=ids[:, -1:], **{cache_kwarg(): cache}, use_cache=True)
        seen.append(("after recording", [layer.keys for layer in cache.layers]))
    return seen


@needs_sliding_rollback
@pytest.mark.parametrize("arch", ["mistral", "gemma3"])
def test_layers_record_their_past_as_dynamic_sliding_layers(arch: str) -> None:
    """Recording switched on and off layer by layer: every layer's keys equal DynamicCache's
    (42 recorded tokens where the window shows 5), the crop rolls back, the past goes afterwards."""
    model = tiny(arch)
    expected = _layer_contract_run(DynamicCache(config=model.config), model)
    cache = hf_vkv.VKVCache(model.config)
    got = _layer_contract_run(cache, model)
    assert expected[0][1][0].shape[2] == 7 * WINDOW + 2  # the reference recorded every token
    for (stage, want), (_, have) in zip(expected, got):
        for idx, (w, h) in enumerate(zip(want, have)):
            assert h.shape == w.shape, f"{stage}, layer {idx}: {tuple(h.shape)} vs {tuple(w.shape)}"
            assert torch.equal(h, w), f"{stage}, layer {idx}"
    cache.check_invariants()
