"""Assisted decoding and prompt-lookup decoding (both crop the cache) with a VKV cache.

Token-identical to DynamicCache with an encoder-decoder model (BART: the self-attention cache of
an ``EncoderDecoderCache`` is a VKVCache) and sliding-window models (Mistral, and Gemma 3 with
sliding and full layers, window 6 < the generated length). And a sliding layer that records its past (what assisted decoding turns on)
shows every recorded token in ``.keys``, as ``DynamicSlidingWindowLayer`` does.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
from breadth_models import WINDOW, prompts, tiny
from models import RECORDS_RECURRENT, needs_sliding_rollback
from transformers.cache_utils import DynamicCache

import hf_vkv
from hf_vkv.cache.hybrid import LinearState
from hf_vkv.generate import cache_kwarg

pytestmark = pytest.mark.integration

NEW = 12  # prompt 10 + 12 new tokens: twice past Mistral's window

@functools.cache
def _encoder_decoder_assisted_runs() -> bool:
    """Whether this transformers' own assisted decoding of an encoder-decoder model runs with
    DynamicCache. 5.25's does not: the decoder's positions grow by every draft's length, cropped
    or not, past BART's position table within a dozen tokens (an IndexError in its embedding)."""
    try:
        tiny("bart").generate(**prompts(1, 10, seed=3), max_new_tokens=NEW, do_sample=False,
                              assistant_model=tiny("bart", depth=1))
    except IndexError:
        return False
    return True


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
    if arch == "bart" and kind == "assisted" and not _encoder_decoder_assisted_runs():
        pytest.skip("this transformers' assisted decoding of BART fails with DynamicCache (positions past the "
                    "position table): there is nothing to compare with")
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


@pytest.mark.skipif(not RECORDS_RECURRENT, reason="transformers < 5.25 refuses assisted decoding on recurrent models")
@pytest.mark.parametrize("arch", ["falcon_h1", "zamba2"])
def test_speculative_decoding_rolls_recurrent_states_back(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Hybrid layers (a recurrent state beside K/V in a group): drafts of five tokens, most
    rejected, so every verification rolls the recurrent state back over several tokens through
    the states recorded meanwhile. Tokens and every step's logits equal DynamicCache's."""
    helper = tiny(arch, depth=2 if arch == "zamba2" else 1)  # (other weights; Zamba2's layer types fix two)
    helper.generation_config.num_assistant_tokens = 5
    helper.generation_config.num_assistant_tokens_schedule = "constant"
    helper.generation_config.assistant_confidence_threshold = 0.0
    crops: list[int] = []
    crop = LinearState.crop
    monkeypatch.setattr(LinearState, "crop", lambda self, n: (crops.append(int(n)), crop(self, n))[1])
    model, inputs = tiny(arch), prompts(1, 10, seed=3)
    kwargs = dict(max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True, output_logits=True,
                  assistant_model=helper)
    ref = model.generate(**inputs, **kwargs)
    assert not crops  # DynamicCache's layers are transformers' own
    got = model.generate(**inputs, cache_implementation="vkv", **kwargs)
    assert min(crops) <= -3, crops  # rolled back over several recorded states
    assert torch.equal(ref.sequences, got.sequences), f"{ref.sequences}\n{got.sequences}"
    assert len(ref.logits) == len(got.logits) and all(torch.equal(a, b) for a, b in zip(ref.logits, got.logits))
    assert isinstance(got.past_key_values, hf_vkv.VKVCache)
    got.past_key_values.check_invariants()
