"""Options that cannot do what they say are refused before anything runs.

* ``cache_config['max_tokens']`` (or transformers' ``max_cache_len``) smaller than what the call
  may cache: a ``CapacityError`` before the prompt's forward, not at the decode step that would
  pass it; a capacity that fits gives DynamicCache's tokens;
* the paged layout's options (``block_tokens``, ``paged_kernel``) on a cache whose layout is not
  paged (the model's attention is not ``"vkv_paged"``): a ``CacheOptionError`` saying what reads
  them, where before they were silently ignored; under ``"vkv_paged"`` they are taken.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from models import assert_same_tokens, prompts, tiny

from hf_vkv import CacheOptionError, CapacityError, VKVCache

pytestmark = pytest.mark.integration


@contextmanager
def _forwards(model: Any) -> Iterator[list[int]]:
    """The model's forwards while the block runs (one entry per forward)."""
    seen: list[int] = []
    handle = model.register_forward_pre_hook(lambda *_: seen.append(1))
    try:
        yield seen
    finally:
        handle.remove()


@pytest.mark.parametrize("key", ["max_tokens", "max_cache_len"])
@pytest.mark.parametrize("beams", [1, 2])
def test_a_capacity_short_of_the_call_is_refused_before_the_prompt_runs(key: str, beams: int) -> None:
    model = tiny("llama")
    inputs = prompts(2, 7)
    needed = 7 + 4 - 1  # the prompt and max_new_tokens, less the last token (never cached)
    with _forwards(model) as seen, pytest.raises(CapacityError, match=rf"\['{key}'\]={needed - 1} holds fewer tokens "
                                                 rf"than this call may cache: {needed} .* at least {needed}"):
        model.generate(**inputs, cache_implementation="vkv", cache_config={key: needed - 1}, max_new_tokens=4,
                       num_beams=beams, do_sample=False)
    assert not seen  # refused before the prompt's forward
    expected = model.generate(**inputs, max_new_tokens=4, num_beams=beams, do_sample=False)
    got = model.generate(**inputs, cache_implementation="vkv", cache_config={key: needed}, max_new_tokens=4,
                         num_beams=beams, do_sample=False)
    assert_same_tokens(expected, got)


@pytest.mark.parametrize("option", [{"block_tokens": 16}, {"paged_kernel": "fused"}])
def test_paged_options_need_the_paged_layout(option: dict[str, Any]) -> None:
    model = tiny("llama")
    name = next(iter(option))
    with _forwards(model) as seen, pytest.raises(CacheOptionError, match=rf"\['{name}'\] applies to the paged layout "
                                                 r"only.*attn_implementation='vkv_paged'"):
        model.generate(**prompts(1, 5), cache_implementation="vkv", cache_config=option, max_new_tokens=2)
    assert not seen
    with pytest.raises(CacheOptionError, match=rf"\['{name}'\] applies to the paged layout only"):
        VKVCache(config=model.config, **option)  # by hand: the layout is the device's contiguous default
    with pytest.raises(CacheOptionError, match=rf"\['{name}'\] applies to the paged layout only"):
        VKVCache(config=model.config, layout="head_major", **option)


def test_paged_options_are_taken_under_the_paged_attention() -> None:
    model = tiny("llama")
    inputs = prompts(2, 9)
    expected = model.generate(**inputs, max_new_tokens=5, do_sample=False)
    model.set_attn_implementation("vkv_paged")
    try:
        cache = VKVCache(config=model.config, block_tokens=8)
        assert cache.layout == "paged" and cache.options.block_tokens == 8
        got = model.generate(**inputs, cache_implementation="vkv", cache_config={"block_tokens": 8}, max_new_tokens=5,
                             do_sample=False)
    finally:
        model.set_attn_implementation("sdpa")
    assert_same_tokens(expected, got)
    assert isinstance(got, torch.Tensor)
