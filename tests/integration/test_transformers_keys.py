"""transformers' own ``cache_config`` keys given to ``cache_implementation="vkv"``: accepted where
vkv has the same meaning, else an error naming the key, saying vkv does not offer it and what it
offers instead (:data:`hf_vkv.cache.options.TRANSFORMERS_KEYS`)."""

from __future__ import annotations

import inspect

import pytest
import torch
from transformers.cache_utils import Cache, DynamicCache, QuantizedCache, StaticCache

import hf_vkv
from hf_vkv.cache import CacheOptions
from hf_vkv.cache.options import TRANSFORMERS_KEYS
from models import assert_same_tokens, prompts, tiny

pytestmark = pytest.mark.integration


def test_every_constructor_option_of_transformers_caches_is_known() -> None:
    """A new option of transformers' cache classes shows up here (the table says what vkv does)."""
    names = set()
    for cls in (Cache, DynamicCache, StaticCache, QuantizedCache):
        names |= {n for n, p in inspect.signature(cls.__init__).parameters.items()
                  if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD}
    names -= {"self", "config", "layers", "layer_class_to_replicate", "ddp_cache_data"}
    assert names <= set(TRANSFORMERS_KEYS), f"transformers cache options without a vkv answer: {names - set(TRANSFORMERS_KEYS)}"


def test_same_meaning_is_accepted() -> None:
    assert CacheOptions.from_dict({"max_cache_len": 64}).max_tokens == 64
    assert CacheOptions.from_dict({"max_cache_len": 64, "max_tokens": 64}).max_tokens == 64
    assert CacheOptions.from_dict({"offloading": False, "offload_only_non_sliding": True}) == CacheOptions()
    with pytest.raises(ValueError, match=r"cache_config\['max_cache_len'\]=8 and cache_config\['max_tokens'\]=9 disagree"):
        CacheOptions.from_dict({"max_cache_len": 8, "max_tokens": 9})


@pytest.mark.parametrize("key, value, offers", [
    ("offloading", True, "budget_bytes"),
    ("offload_only_non_sliding", False, "offloading"),
    ("backend", "quanto", "cache_implementation='quantized'"),
    ("nbits", 4, "does not quantize"),
    ("residual_length", 128, "does not quantize"),
    ("max_batch_size", 4, "rows from generate"),
    ("device", "cpu", "device of its first states"),
])
def test_other_keys_name_themselves_and_what_vkv_offers(key: str, value: object, offers: str) -> None:
    config = {key: value, **({"offloading": True} if key == "offload_only_non_sliding" else {})}
    with pytest.raises(ValueError, match=rf"cache_config\['(offloading|{key})'\]=.* does not offer: .*{offers}"):
        CacheOptions.from_dict(config)
    with pytest.raises(ValueError, match="does not offer"):
        hf_vkv.VKVCache(config=tiny("llama").config, **config)


def test_generate_with_transformers_keys() -> None:
    """Through generate: max_cache_len sizes the static layout as StaticCache's capacity;
    offloading=True is refused before anything runs."""
    model, inputs = tiny("llama"), prompts(1, 6)
    ref = model.generate(**inputs, max_new_tokens=4, cache_implementation="static",
                         cache_config={"max_cache_len": 48}, return_dict_in_generate=True)
    got = model.generate(**inputs, max_new_tokens=4, cache_implementation="vkv",
                         cache_config={"layout": "static", "max_cache_len": 48}, return_dict_in_generate=True)
    assert_same_tokens(ref.sequences, got.sequences)
    cache = got["cache"] if "cache" in got else got["past_key_values"]
    assert cache.get_max_length() == 48
    with torch.no_grad(), pytest.raises(ValueError, match=r"cache_config\['offloading'\]=True .* does not offer"):
        model.generate(**inputs, max_new_tokens=2, cache_implementation="vkv", cache_config={"offloading": True})
