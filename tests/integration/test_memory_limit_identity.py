"""Memory at the limit (rule 6 of :func:`hf_vkv.devices.choose_layout`): a short prompt sampled
n times gets token-major with its small pages when ``cache_config`` names no layout, holds no more
K/V than DynamicCache, and generates DynamicCache's tokens."""

from __future__ import annotations

import pytest
import torch

from hf_vkv.devices import TOKEN_MAJOR_PAGE_BYTES, Workload, choose_layout, head_major_excess
from hf_vkv.generate import cache_kwarg
from models import assert_same_tokens, prompts, tiny

pytestmark = pytest.mark.integration


def _sample(model, inputs, n, new, **kwargs):
    torch.manual_seed(1234)
    return model.generate(**inputs, do_sample=True, num_return_sequences=n, max_new_tokens=new, min_new_tokens=new,
                          return_dict_in_generate=True, **kwargs)


@pytest.mark.parametrize("n", [1, 4])
def test_short_prompt_sampling_picks_token_major_and_matches_dynamic_cache(n):
    model = tiny("llama")
    inputs = prompts(1, 5)
    new = 6
    ref = _sample(model, inputs, n, new)
    out = _sample(model, inputs, n, new, cache_implementation="vkv")
    cache = out[cache_kwarg()]
    assert cache.layout == "token_major"
    assert {a.backend.page_bytes for a in cache._arenas.values()} == {TOKEN_MAJOR_PAGE_BYTES}
    assert_same_tokens(ref.sequences, out.sequences)
    # a tiny llama token is 512 bytes (a page holds 8), so DynamicCache's exact bytes are not the
    # bound here (SmolLM2's token is 46,080 bytes: benchmarks/memory_limit.py); head-major's pages are
    head = _sample(model, inputs, n, new, cache_implementation="vkv", cache_config={"layout": "head_major"})
    assert_same_tokens(ref.sequences, head.sequences)
    assert cache.stats().resident_bytes < head[cache_kwarg()].stats().resident_bytes
    assert cache.stats().resident_bytes <= cache.stats().token_bytes + 2 * n * TOKEN_MAJOR_PAGE_BYTES

def test_the_head_major_case_is_the_rules_choice_and_matches_too():
    # the tiny llama's head-major page holds 64 tokens (16 dims x 4 bytes): head-major's partly
    # written pages exceed the slack for any prompt it can take, so its default is token-major; a
    # layout named in cache_config stays, with the same tokens
    model = tiny("llama")
    item = 16 * 4
    assert head_major_excess(Workload(rows=4, prompt_tokens=5, prompt_repeats=4, item_bytes=item)) > 0.03
    assert choose_layout(None, Workload(device_type="cpu", rows=4, prompt_tokens=5, prompt_repeats=4, item_bytes=item,
                                        subrows=8, mappings_free=10**6)) == "token_major"
    inputs = prompts(1, 5)
    ref = _sample(model, inputs, 4, 6)
    out = _sample(model, inputs, 4, 6, cache_implementation="vkv", cache_config={"layout": "head_major"})
    assert out[cache_kwarg()].layout == "head_major"
    assert_same_tokens(ref.sequences, out.sequences)


def test_greedy_batch_and_beams_match_dynamic_cache():
    model = tiny("llama")
    inputs = prompts(2, 7, left_pad=[0, 3])
    ref = model.generate(**inputs, max_new_tokens=5, return_dict_in_generate=True)
    out = model.generate(**inputs, max_new_tokens=5, cache_implementation="vkv", return_dict_in_generate=True)
    assert out[cache_kwarg()].layout == "token_major"
    assert_same_tokens(ref.sequences, out.sequences)
    ref = model.generate(**prompts(1, 9), num_beams=3, max_new_tokens=5, return_dict_in_generate=True)
    out = model.generate(**prompts(1, 9), num_beams=3, max_new_tokens=5, cache_implementation="vkv",
                         return_dict_in_generate=True)
    assert out[cache_kwarg()].layout == "token_major"
    assert_same_tokens(ref.sequences, out.sequences)
